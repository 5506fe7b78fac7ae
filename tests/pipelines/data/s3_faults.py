"""An HTTP proxy in front of the moto S3 server that refuses batch deletes the way S3 does.

S3 answers a DeleteObjects request it partly refuses (object lock, a bucket policy, a KMS key the
caller may not use) with HTTP 200 and one `<Error>` per refused key: a client that only catches
exceptions never notices. moto only produces such errors for version-specific deletes under object
lock, so this proxy forwards every request to the real server except `POST /<bucket>?delete`, which
it answers with AccessDenied for each key, exactly as S3 words it. Nothing reaches our code but HTTP.
"""
from __future__ import annotations

import http.client
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "trailer", "upgrade"}


def _delete_result(body: bytes) -> bytes:
    keys = re.findall(rb"<Key>(.*?)</Key>", body, flags=re.S)
    errors = b"".join(b"<Error><Key>" + k + b"</Key><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"
                      for k in keys)
    return (b'<?xml version="1.0" encoding="UTF-8"?>\n<DeleteResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            + errors + b"</DeleteResult>")


class DenyDeletes:
    """Context manager: `url` is the proxy's endpoint; `refused` counts the delete requests it refused."""

    def __init__(self, upstream: str):
        self.upstream = urlsplit(upstream)
        self.refused = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):   # keep the test output readable
                pass

            def _relay(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.command == "POST" and re.search(r"[?&]delete(=|&|$)", self.path):
                    outer.refused += 1
                    self._answer(200, {"Content-Type": "application/xml"}, _delete_result(body))
                    return
                conn = http.client.HTTPConnection(outer.upstream.hostname, outer.upstream.port, timeout=30)
                try:
                    conn.request(self.command, self.path, body=body or None,
                                 headers={k: v for k, v in self.headers.items() if k.lower() not in _HOP})
                    resp = conn.getresponse()
                    payload = resp.read()
                    drop = _HOP if self.command == "HEAD" else _HOP | {"content-length"}
                    self._answer(resp.status, {k: v for k, v in resp.getheaders() if k.lower() not in drop}, payload)
                finally:
                    conn.close()

            def _answer(self, status: int, headers: dict, payload: bytes):
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                if self.command != "HEAD":
                    self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> "DenyDeletes":
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
