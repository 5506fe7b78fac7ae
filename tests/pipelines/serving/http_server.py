"""`python -m pipelines serve` as a real process for the HTTP tests, and a small JSON client."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import mlflow
import pandas as pd

from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class Served:
    url: str
    log: Path
    proc: subprocess.Popen | None = None

    def call(
        self,
        path: str,
        body: object = None,
        *,
        raw: bytes | None = None,
        headers: dict | None = None,
        timeout: float = 60,
    ) -> tuple[int, object]:
        """(status, decoded JSON or text) of GET `path`, or POST of `body` (JSON) / `raw` bytes."""
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        req = urllib.request.Request(
            self.url + path,
            data=data,
            method="GET" if data is None else "POST",
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                status, text = r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            status, text = e.code, e.read().decode()
        try:
            return status, json.loads(text)
        except ValueError:
            return status, text

    def score(self, frame: pd.DataFrame) -> dict:
        status, out = self.call("/invocations", split(frame))
        assert status == 200, out
        return out

    def routes(self) -> dict:
        return self.call("/routes")[1]["routes"]

    def wait_for(self, probe, timeout_s: float = 60):
        """The first truthy value `probe()` returns, polled every 50 ms."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = probe()
            if value:
                return value
            time.sleep(0.05)
        raise AssertionError(f"gave up waiting; /routes: {self.call('/routes')[1]}\n{self.log.read_text()[-3000:]}")

    def wait_for_route(self, route: str, key: str, timeout_s: float = 60) -> float:
        """Seconds until /routes shows `route` -> `key`."""
        start = time.monotonic()
        self.wait_for(lambda: self.routes().get(route) == key, timeout_s)
        return time.monotonic() - start


def split(frame: pd.DataFrame) -> dict:
    """`frame` as MLflow's dataframe_split body (JSON-native values)."""
    return {"dataframe_split": json.loads(frame.to_json(orient="split", index=False, date_format="iso"))}


@contextlib.contextmanager
def serve(
    tmp: Path,
    *,
    config: str = "configs/synthetic.yaml",
    poll_seconds: float = 0.5,
    env: dict | None = None,
    extra: tuple[str, ...] = (),
    ready: bool = True,
) -> Iterator[Served]:
    """The server on a free port, ready (/healthz 200) on entry unless `ready` is False, stopped
    (SIGTERM) on exit."""
    port = free_port()
    log = tmp / f"serve-{port}.log"
    env = {**os.environ, "MLFLOW_TRACKING_URI": mlflow.get_tracking_uri(), "PYTHONPATH": str(REPO), **(env or {})}
    cmd = [
        sys.executable,
        "-m",
        "pipelines",
        "serve",
        "--config",
        str(REPO / config),
        "--port",
        str(port),
        "--poll-seconds",
        str(poll_seconds),
        "--canary-share",
        "0",
        *extra,
    ]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    served = Served(f"http://127.0.0.1:{port}", log, proc)
    try:
        if ready:
            wait_ready(served)
        yield served
    finally:
        _stop(proc)


@contextlib.contextmanager
def mlflow_models_serve(model_uri: str, tmp: Path) -> Iterator[str]:
    """`mlflow models serve -m model_uri --env-manager local` on a free port; yields its URL once /ping is 200."""
    port = free_port()
    served = Served(f"http://127.0.0.1:{port}", tmp / "models-serve.log")
    # as in an activated environment: MLflow runs `uvicorn` from PATH
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": mlflow.get_tracking_uri(),
        "PYTHONPATH": str(REPO),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    cmd = [
        str(Path(sys.executable).with_name("mlflow")),
        "models",
        "serve",
        "-m",
        model_uri,
        "--env-manager",
        "local",
        "-h",
        "127.0.0.1",
        "-p",
        str(port),
    ]
    with open(served.log, "wb") as fh:
        proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ready(served, proc, path="/ping")
        yield served.url
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def wait_ready(
    served: Served, proc: subprocess.Popen | None = None, timeout_s: float = 120, path: str = "/healthz"
) -> None:
    proc = proc or served.proc
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(OSError):
            if served.call(path, timeout=2)[0] == 200:
                return
        time.sleep(0.3)
    raise AssertionError(f"the serving process is not ready (exit {proc.poll()}):\n{served.log.read_text()[-4000:]}")
