"""The lake rides out transient S3 failures and fails clearly beyond its retry budget.

`FaultProxy` stands between the library and the real moto S3 server (over HTTP): it spoils the first
N requests that match with a 503, a reset connection, or a body cut off mid-way, and forwards every
other request untouched. Nothing reaches our code but HTTP; tests/pipelines/registry/
test_mlflow_retries.py puts the same proxy in front of a real `mlflow server`.
"""
from __future__ import annotations

import http.client
import socket
import struct
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest

from pipelines.data import lake as lake_mod
from pipelines.data.lake import Lake
from pipelines.errors import LakeError
from tests.pipelines.data.test_lake import contract_frame

_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "trailer", "upgrade"}
FAULTS = ("503", "reset", "truncate")


class FaultProxy:
    """Context manager. `url`: the proxy's endpoint. The first `failures` requests for which
    `match(method, path)` holds get `fault`; `faulted` and `forwarded` list (method, path) as seen."""

    def __init__(self, upstream: str, fault: str, failures: int,
                 match: Callable[[str, str], bool] = lambda method, path: True):
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
            conn.request(method, path, body=body or None,
                         headers={k: v for k, v in headers.items() if k.lower() not in _HOP})
            resp = conn.getresponse()
            return resp.status, resp.getheaders(), resp.read()
        finally:
            conn.close()

    def _handler(self):
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):   # keep the test output readable
                pass

            def _relay(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                fault = proxy.fault if proxy._should_fault(self.command, self.path) else None
                if fault == "reset":
                    self._reset()
                    return
                if fault == "503":
                    status, headers, payload = 503, [("Content-Type", "text/plain")], b"Service Unavailable"
                else:
                    status, headers, payload = proxy._forward(self.command, self.path, self.headers, body)
                self.send_response(status)
                for k, v in headers:
                    if k.lower() not in _HOP | {"content-length"}:
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if self.command == "HEAD":
                    return
                if fault == "truncate":   # the whole length announced, half of it sent
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


def object_get(method: str, path: str) -> bool:
    """A GET of one object (not a listing: those carry a query string)."""
    return method == "GET" and "?" not in path


def object_put(method: str, path: str) -> bool:
    return method == "PUT"


@pytest.fixture
def legacy_mode_in_env(monkeypatch):
    """AWS_RETRY_MODE=legacy and no AWS_MAX_ATTEMPTS in the environment: the library's config must win."""
    monkeypatch.delenv("AWS_MAX_ATTEMPTS", raising=False)
    monkeypatch.setenv("AWS_RETRY_MODE", "legacy")   # must not win over the library's own config


@pytest.mark.parametrize("fault", ["503", "reset"])
def test_writes_and_reads_survive_transient_failures(s3_bucket, s3_endpoint, legacy_mode_in_env, fault):
    frame = contract_frame("2024-01-01", 40, seed=5)
    with FaultProxy(s3_endpoint, fault, failures=2, match=object_put) as proxy:
        Lake(f"s3://{s3_bucket}/clicks", endpoint_url=proxy.url).write_partition(frame, "2024-01-01")
    assert len(proxy.faulted) == 2 and any(m == "PUT" for m, _ in proxy.forwarded)
    with FaultProxy(s3_endpoint, fault, failures=2, match=object_get) as proxy:
        part = Lake(f"s3://{s3_bucket}/clicks", endpoint_url=proxy.url).read_partition("2024-01-01")
    assert len(proxy.faulted) == 2
    assert part.frame.reset_index(drop=True).equals(frame.reset_index(drop=True))


def test_beyond_the_retry_budget_a_clear_lake_error(s3_bucket, s3_endpoint, monkeypatch):
    Lake(f"s3://{s3_bucket}/clicks").write_partition(contract_frame("2024-01-01", 10), "2024-01-01")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "3")
    with FaultProxy(s3_endpoint, "503", failures=1000, match=object_get) as proxy:
        with pytest.raises(LakeError) as err:
            Lake(f"s3://{s3_bucket}/clicks", endpoint_url=proxy.url).read_partition("2024-01-01")
    msg = str(err.value)
    assert f"cannot read s3://{s3_bucket}/clicks/dt=2024-01-01/" in msg and "reached max retries: 2" in msg
    # one object read, three attempts: the budget is what it says, and nothing more was attempted
    assert len(proxy.faulted) == 3 and len({p for _, p in proxy.faulted}) == 1


def test_a_deterministic_error_is_not_retried(s3_bucket, s3_endpoint):
    """A missing object answers 404 once: retrying it would only delay the refusal."""
    with FaultProxy(s3_endpoint, "503", failures=0) as proxy:
        lake = Lake(f"s3://{s3_bucket}/clicks", endpoint_url=proxy.url)
        with pytest.raises(LakeError, match="cannot read"):
            lake.get_bytes("dt=2024-01-01/nothing.parquet")
    assert [m for m, p in proxy.forwarded if p.endswith("nothing.parquet")] == ["GET"]


def test_every_client_uses_standard_retries(monkeypatch):
    monkeypatch.setenv("AWS_RETRY_MODE", "legacy")
    monkeypatch.delenv("AWS_MAX_ATTEMPTS", raising=False)
    retries = lake_mod.s3_client("http://127.0.0.1:9").meta.config.retries
    assert retries == {"mode": "standard", "total_max_attempts": lake_mod.S3_MAX_ATTEMPTS}
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "4")
    assert Lake("s3://b/x", endpoint_url="http://127.0.0.1:9").client.meta.config.retries["total_max_attempts"] == 4
    for bad in ("0", "-1", "many"):
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", bad)
        with pytest.raises(LakeError, match="AWS_MAX_ATTEMPTS"):
            lake_mod.s3_client()


def test_a_body_cut_off_midway_fails_closed(s3_bucket, s3_endpoint):
    """botocore retries until a response starts; a body that then breaks off is not retried. The read
    must fail naming the object, never hand back a short part (the Airflow task retries it)."""
    Lake(f"s3://{s3_bucket}/clicks").write_partition(contract_frame("2024-01-01", 200), "2024-01-01")
    with FaultProxy(s3_endpoint, "truncate", failures=1000, match=object_get) as proxy:
        with pytest.raises(LakeError, match=f"cannot read s3://{s3_bucket}/clicks/dt=2024-01-01/"):
            Lake(f"s3://{s3_bucket}/clicks", endpoint_url=proxy.url).read_partition("2024-01-01")
