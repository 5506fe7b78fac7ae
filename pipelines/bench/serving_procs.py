"""What both serving benchmarks share: the synthetic request rows they score (`request_frame`), and the
processes `pipelines.bench.serving_http` measures: a real `mlflow server` that may send alias webhooks to
loopback, and `python -m pipelines serve`, each in its own session, pinned to cores apart from the clients
where the machine allows it."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
from cryptography.fernet import Fernet

from pipelines.data.synthetic import SyntheticSpec, generate_day

SECRET = "bench-serving-webhook-secret"
REPO = Path(__file__).resolve().parents[2]


def _cores() -> dict[str, set[int] | None]:
    """The serving process on cores of its own (the upper half), the clients and the MLflow server on
    the rest: on a shared machine they would otherwise take the server's cores, which a deployment
    does not do. None (no pinning) where affinity is not available or there is one core."""
    if not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2:
        return {"server": None, "others": None}
    cpus = sorted(os.sched_getaffinity(0))
    half = len(cpus) // 2
    return {"server": set(cpus[half:]), "others": set(cpus[:half])}


CORES = _cores()
DAY = "2024-01-08"


def request_frame(rows: int):
    """Synthetic click-log rows of one day: what both serving benchmarks score."""
    return pd.concat(list(generate_day(SyntheticSpec(seed=3), DAY, rows)), ignore_index=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _process(
    cmd: list[str], log: Path, env: dict, url: str, ready_path: str, cpus: set[int] | None = None
) -> Iterator[subprocess.Popen]:
    """`cmd` in its own session (on `cpus` only, when given) until `url + ready_path` answers 200;
    SIGTERM (then SIGKILL) on exit."""
    pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            cmd, cwd=log.parent, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=pin
        )
    try:
        deadline = time.monotonic() + 180
        while proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(OSError, http.client.HTTPException):
                if get_json(url, ready_path)[0] == 200:
                    break
            time.sleep(0.3)
        else:
            raise RuntimeError(f"{cmd[:4]} did not become ready (exit {proc.poll()}):\n{log.read_text()[-3000:]}")
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def get_json(url: str, path: str) -> tuple[int, object]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        body = r.read()
        return r.status, json.loads(body) if r.getheader("content-type", "").startswith("application/json") else body
    finally:
        conn.close()


@contextlib.contextmanager
def mlflow_server(root: Path) -> Iterator[str]:
    """A tracking + registry server that may send webhooks to loopback over plain HTTP."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "MLFLOW_WEBHOOK_ALLOWED_SCHEMES": "http,https",
        "MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS": "true",
        "MLFLOW_WEBHOOK_SECRET_ENCRYPTION_KEY": Fernet.generate_key().decode(),
        "MLFLOW_WEBHOOK_CACHE_TTL": "1",
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    }
    cmd = [
        str(Path(sys.executable).with_name("mlflow")),
        "server",
        "--backend-store-uri",
        f"sqlite:///{root / 'mlflow.db'}",
        "--artifacts-destination",
        str(root / "artifacts"),
        "--serve-artifacts",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    with _process(cmd, root / "mlflow-server.log", env, url, "/health", CORES["others"]):
        yield url


@contextlib.contextmanager
def serving(root: Path, tracking_uri: str, *, port: int, poll_seconds: float, webhook: bool) -> Iterator[str]:
    url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": tracking_uri,
        "PYTHONPATH": str(REPO),
        "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
    }
    env.pop("CTR_SERVING_WEBHOOK_SECRET", None)
    if webhook:
        env["CTR_SERVING_WEBHOOK_SECRET"] = SECRET
    cmd = [
        sys.executable,
        "-m",
        "pipelines",
        "serve",
        "--config",
        str(REPO / "configs" / "synthetic.yaml"),
        "--port",
        str(port),
        "--poll-seconds",
        str(poll_seconds),
        "--canary-share",
        "0",
    ]
    with _process(cmd, root / f"serve-{port}.log", env, url, "/healthz", CORES["server"]):
        yield url
