"""A fault-injecting HTTP proxy in front of a real server (moto's S3, an `mlflow server`).

`FaultProxy` forwards every request untouched except the first N that match, which get a 503, a
reset connection, a body cut off mid-way, or (`deny_deletes`) the answer S3 gives a DeleteObjects
request it partly refuses (object lock, a bucket policy, a KMS key the caller may not use): HTTP 200
with one `<Error>` per key, which a client that only catches exceptions never notices. moto only
produces such errors for version-specific deletes under object lock. Nothing reaches our code but HTTP.
"""

from __future__ import annotations

import http.client
import re
import socket
import struct
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "trailer", "upgrade"}
FAULTS = ("503", "reset", "truncate", "deny_deletes")


def _delete_result(body: bytes) -> bytes:
    keys = re.findall(rb"<Key>(.*?)</Key>", body, flags=re.S)
    errors = b"".join(
        b"<Error><Key>" + k + b"</Key><Code>AccessDenied</Code><Message>Access Denied</Message></Error>" for k in keys
    )
    return (
        b'<?xml version="1.0" encoding="UTF-8"?>\n<DeleteResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
        + errors
        + b"</DeleteResult>"
    )


class FaultProxy:
    """Context manager. `url`: the proxy's endpoint. The first `failures` requests for which
    `match(method, path)` holds get `fault`; `faulted` and `forwarded` list (method, path) as seen."""

    def __init__(
        self, upstream: str, fault: str, failures: int, match: Callable[[str, str], bool] = lambda method, path: True
    ):
        assert fault in FAULTS, fault
        self.upstream, self.fault, self.failures, self.match = urlsplit(upstream), fault, failures, match
        self.faulted: list[tuple[str, str]] = []
        self.forwarded: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def _should_fault(self, method: str, path: str) -> bool:
        with self._lock:
            if len(self.faulted) < self.failures and self.match(method, path):
                self.faulted.append((method, path))
                return True
            self.forwarded.append((method, path))
            return False

    def _forward(self, method: str, path: str, headers, body: bytes):
        conn = http.client.HTTPConnection(self.upstream.hostname, self.upstream.port, timeout=60)
        try:
            conn.request(
                method, path, body=body or None, headers={k: v for k, v in headers.items() if k.lower() not in _HOP}
            )
            resp = conn.getresponse()
            return resp.status, resp.getheaders(), resp.read()
        finally:
            conn.close()

    def _handler(self):
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # keep the test output readable
                pass

            def _relay(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                fault = proxy.fault if proxy._should_fault(self.command, self.path) else None
                if fault == "reset":
                    self._reset()
                    return
                if fault == "503":
                    status, headers, payload = 503, [("Content-Type", "text/plain")], b"Service Unavailable"
                elif fault == "deny_deletes":
                    status, headers, payload = 200, [("Content-Type", "application/xml")], _delete_result(body)
                else:
                    status, headers, payload = proxy._forward(self.command, self.path, self.headers, body)
                self.send_response(status)
                head = self.command == "HEAD"  # a HEAD keeps the object's own Content-Length
                for k, v in headers:
                    if k.lower() not in (_HOP if head else _HOP | {"content-length"}):
                        self.send_header(k, v)
                if not head:
                    self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if head:
                    return
                if fault == "truncate":  # the whole length announced, half of it sent
                    self.wfile.write(payload[: len(payload) // 2])
                    self._reset()
                    return
                self.wfile.write(payload)

            def _reset(self):
                """Close with a TCP RST (SO_LINGER 0), as a crashed server or a dropped link does."""
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.close_connection = True
                self.connection.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _relay

        return Handler

    def __enter__(self) -> "FaultProxy":
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()


def is_batch_delete(method: str, path: str) -> bool:
    return method == "POST" and re.search(r"[?&]delete(=|&|$)", path) is not None


def deny_deletes(upstream: str) -> FaultProxy:
    """A proxy that refuses every batch delete key by key (`faulted` lists them) and forwards the rest."""
    return FaultProxy(upstream, "deny_deletes", failures=sys.maxsize, match=is_batch_delete)
