"""Shared fixtures: a real S3-compatible server (moto's server mode) on 127.0.0.1, over HTTP, and a real
MLflow tracking server (`mlflow_server`, `on_mlflow_server`) whose artifacts it proxies to that S3."""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import mlflow
import mlflow.tracking.fluent as fluent
import pytest
from mlflow import MlflowClient

from pipelines.registry.mlflow_scope import preserved_mlflow, temporary_env

# The test files that take minutes, longest first (`make test` --durations). xdist's loadfile hands
# files out in collection order, so a long file collected last runs alone at the end while the other
# worker idles; collected first, the short files fill in around it.
LONG_FILES = (
    "tests/e2e/test_replay_days.py",
    "tests/e2e/test_stack.py",
    "tests/e2e/test_lifecycle_dags.py",
    "tests/pipelines/bench/test_backtest_served.py",
    "tests/e2e/test_monitor_dag.py",
    "tests/pipelines/bench/test_backtest.py",
    "tests/e2e/test_cold_start_dag.py",
    "tests/pipelines/registry/test_trust.py",
    "tests/pipelines/serving/test_http.py",
    "tests/pipelines/bench/test_serving.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {f: i for i, f in enumerate(LONG_FILES)}
    root = Path(str(config.rootpath))
    items.sort(key=lambda item: rank.get(Path(str(item.path)).relative_to(root).as_posix(), len(rank)))


# What a test may leave set in os.environ besides the URIs: mlflow.set_experiment exports these
_MLFLOW_ACTIVE = ("MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME")


@pytest.fixture(autouse=True)
def _no_mlflow_setting_leaks():
    """Each test leaves MLflow's URIs (globals and variables) and active experiment as it found them.
    mlflow.set_experiment exports MLFLOW_EXPERIMENT_ID, set_registry_uri exports MLFLOW_REGISTRY_URI and
    set_registry_uri(None) leaves it, monkeypatch.delenv of an absent variable restores nothing, and a test may
    set the tracking URI without resetting it: without this, a later test of the worker, or a subprocess it
    starts, would run in an experiment its own store does not have or register to another test's store (which
    test that is depends on xdist's file order)."""
    with preserved_mlflow(_MLFLOW_ACTIVE):
        yield


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_endpoint():
    """Start moto's threaded HTTP server once per session and point boto3 at it via AWS_ENDPOINT_URL."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    s3_env = {
        "AWS_ENDPOINT_URL": endpoint,
        "MLFLOW_S3_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    with temporary_env(s3_env):
        yield endpoint
        server.stop()


@pytest.fixture
def s3_bucket(s3_endpoint):
    """A fresh, empty bucket on the moto server."""
    import boto3

    name = f"test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=name)
    return name


def use_store_copy(template_db, tmp_path, monkeypatch) -> str:
    """Point MLflow (tracking + registry) at a fresh copy of an initialised SQLite store.

    Creating the schema takes seconds, copying the file does not. Any default ./mlruns artifact root
    lands in tmp_path. The caller resets the tracking URI afterwards.
    """
    db = tmp_path / "mlflow.db"
    shutil.copy(template_db, db)
    uri = f"sqlite:///{db}"
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CTR_MLFLOW_ARTIFACT_ROOT", raising=False)
    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
    # An experiment made active in an earlier test's store (mlflow.set_experiment exports it) does not
    # exist in this one.
    monkeypatch.delenv("MLFLOW_EXPERIMENT_ID", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)

    monkeypatch.setattr(fluent, "_active_experiment_id", None)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    return uri


@pytest.fixture(scope="session")
def template_db(tmp_path_factory):
    """An initialised, empty MLflow SQLite store to copy with `use_store_copy`."""
    d = tmp_path_factory.mktemp("mlflow-template")
    uri = f"sqlite:///{d / 'mlflow.db'}"
    MlflowClient(tracking_uri=uri, registry_uri=uri).search_experiments()
    return d / "mlflow.db"


# ----------------------------------------------------------------------------- a real MLflow tracking server
# Registry code must work against `mlflow server` over HTTP, not only a directly opened store
# (issue 11). One server per session: PostgreSQL backend (a fresh database), artifacts proxied by
# the server to a bucket on the moto S3 server, so clients need nothing but the tracking URI.

REDIS_URL = "redis://127.0.0.1:6379/15"  # db 15: out of the way of a Celery broker on db 0


@contextlib.contextmanager
def fresh_database(prefix: str, fallback_dir: Path):
    """A fresh PostgreSQL database `<prefix><hex>` as a SQLAlchemy URI, dropped WITH (FORCE) afterwards;
    a SQLite file in `fallback_dir` when PostgreSQL is unreachable, unless CTR_REQUIRE_POSTGRES=1."""
    from tests.e2e.stack import PG, postgres_available

    if postgres_available():
        import psycopg2

        name = f"{prefix}{uuid.uuid4().hex[:10]}"
        conn = psycopg2.connect(**PG)
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(f'CREATE DATABASE "{name}"')
        try:
            yield f"postgresql://postgres@127.0.0.1:5432/{name}"
        finally:
            with conn.cursor() as cur:
                cur.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            conn.close()
    elif os.environ.get("CTR_REQUIRE_POSTGRES") == "1":
        pytest.fail("CTR_REQUIRE_POSTGRES=1 but PostgreSQL at 127.0.0.1:5432 is not reachable")
    else:
        yield f"sqlite:///{fallback_dir / f'{prefix}mlflow.db'}"


def redis_available(url: str = REDIS_URL) -> bool:
    try:
        import redis

        with redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2) as r:
            return bool(r.ping())
    except Exception:
        return False


def cross_machine_lock_url(backend: str) -> str | None:
    """A CTR_REGISTRY_LOCK_URL for clients of a tracking server on `backend`: the backend database itself
    when it is PostgreSQL (what production does), else Redis when reachable, else None."""
    if backend.startswith("postgresql"):
        return backend
    return REDIS_URL if redis_available() else None


def start_mlflow_server(
    backend: str, port: int, artifact_args: list[str], cwd: Path, env: dict | None = None, timeout_s: float = 120
) -> subprocess.Popen:
    """`mlflow server` on 127.0.0.1:`port` (one uvicorn worker, no job runner), healthy on return.

    Its own session (process group), so `stop_mlflow_server` ends the CLI and its uvicorn child by
    the CLI's PID. Output goes to cwd/mlflow-server-<port>.log, quoted when it does not come up."""
    cmd = [
        str(Path(sys.executable).with_name("mlflow")),
        "server",
        "--backend-store-uri",
        backend,
        *artifact_args,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    # The job runner is a second long-lived process the registry never uses.
    env = {**(env or os.environ), "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    log_path = Path(cwd) / f"mlflow-server-{port}.log"
    with open(log_path, "wb") as log_fh:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log_fh, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.3)
    stop_mlflow_server(proc)
    raise AssertionError(
        f"mlflow server on port {port} did not become healthy (exit {proc.returncode}):\n"
        + log_path.read_text(errors="replace")[-4000:]
    )


def stop_mlflow_server(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (CLI + uvicorn), SIGKILL if it is still there after 30 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):  # a uvicorn child that outlived its CLI
        os.killpg(proc.pid, signal.SIGKILL)


@dataclass(frozen=True)
class MlflowServer:
    uri: str  # http://127.0.0.1:PORT: all a client needs
    backend: str  # the backend store: postgresql://…/ctr_test_mlflow_<hex>, or sqlite:///… (fallback)
    artifacts: str  # where the server puts artifacts: s3://<bucket>/mlflow on the moto server
    lock_url: str | None  # a CTR_REGISTRY_LOCK_URL for its clients (see cross_machine_lock_url)
    pid: int


@pytest.fixture(scope="session")
def mlflow_server(s3_endpoint, tmp_path_factory):
    """A real `mlflow server` for the session (see MlflowServer): a fresh PostgreSQL database as backend
    (SQLite when PostgreSQL is unreachable and CTR_REQUIRE_POSTGRES != 1), artifacts proxied to a fresh
    bucket on the moto S3 server (`--artifacts-destination … --serve-artifacts`)."""
    import boto3

    tmp = tmp_path_factory.mktemp("mlflow-server")
    bucket = f"mlflow-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=bucket)
    # Only the server talks to S3; these reach moto whatever the calling process's environment says.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_TRACKING", "MLFLOW_REGISTRY"))}
    env.update(
        MLFLOW_S3_ENDPOINT_URL=s3_endpoint,
        AWS_ENDPOINT_URL=s3_endpoint,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
    )
    with fresh_database("ctr_test_mlflow_", tmp) as backend:
        port = free_port()
        artifacts = f"s3://{bucket}/mlflow"
        proc = start_mlflow_server(
            backend, port, ["--artifacts-destination", artifacts, "--serve-artifacts"], cwd=tmp, env=env
        )
        try:
            yield MlflowServer(
                f"http://127.0.0.1:{port}", backend, artifacts, cross_machine_lock_url(backend), proc.pid
            )
        finally:
            stop_mlflow_server(proc)


def use_mlflow_server(server: MlflowServer, tmp_path: Path, monkeypatch) -> str:
    """Point this process (MLFLOW_TRACKING_URI + mlflow.set_tracking_uri) at `server`, as its clients are
    configured: no CTR_MLFLOW_ARTIFACT_ROOT (experiments get the server's mlflow-artifacts:/ root) and
    CTR_REGISTRY_LOCK_URL = server.lock_url (skips the test when there is none). cwd is tmp_path; the
    caller resets the tracking URI afterwards (monkeypatch restores the environment)."""
    if server.lock_url is None:
        pytest.skip("no cross-machine registry lock: PostgreSQL and Redis are both unreachable")
    monkeypatch.chdir(tmp_path)
    for k in ("CTR_MLFLOW_ARTIFACT_ROOT", "MLFLOW_REGISTRY_URI", "MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(fluent, "_active_experiment_id", None)
    monkeypatch.setenv("CTR_REGISTRY_LOCK_URL", server.lock_url)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)
    mlflow.set_tracking_uri(server.uri)
    return server.uri


@pytest.fixture
def on_mlflow_server(mlflow_server, tmp_path, monkeypatch):
    """This test's process on the session's `mlflow_server` (see use_mlflow_server); yields the server.
    The server is shared: use model names of your own, or assert only on what the test created."""
    use_mlflow_server(mlflow_server, tmp_path, monkeypatch)
    yield mlflow_server
    mlflow.set_tracking_uri(None)


# ----------------------------------------------------------------------------- validated lakes
def validate_lake(lake_uri: str, cfg=None) -> dict:
    """Run the real validation stage over every committed partition of `lake_uri`, as the DAGs' validate
    task does before anything trains: training, evaluation and cold start read only partitions whose
    marker says `passed` for their content (pipelines.data.validated). Raises if a day fails.
    `cfg` defaults to the synthetic slots with the default validation settings."""
    from pipelines.config import DataConfig, PipelineConfig
    from pipelines.data.lake import Lake
    from pipelines.data.synthetic import SLOTS
    from pipelines.validation.stage import validate_window

    days = Lake(lake_uri).list_partitions()
    assert days, f"no committed partition in {lake_uri} to validate"
    cfg = cfg or PipelineConfig(data=DataConfig(lake_uri=lake_uri, slots=SLOTS))
    span = (dt.date.fromisoformat(days[-1]) - dt.date.fromisoformat(days[0])).days + 1
    return validate_window(cfg, lake_uri, days[-1], span)


# ----------------------------------------------------------------------------- synthetic adapter versions
# An adapter version is released only on the base it records (`aliases.check_promotable`: a version
# without `base.fingerprint` is refused). Tests that register synthetic versions (a source that is
# never downloaded) give them the serving base's fingerprint, made here when the store has none.
TEST_BASE_FINGERPRINT = "b" * 64


def serving_base_fingerprint(base: str = "ctr_base") -> str:
    """The fingerprint of `base@champion` in the current store; a synthetic base version is registered
    and made champion first when there is none (idempotent)."""
    from pipelines.registry import mlflow_io

    mv = mlflow_io.version_by_alias(base, "champion")
    if mv is not None:
        return mv.tags["fingerprint"]
    c = MlflowClient()
    try:
        c.create_registered_model(base)
    except Exception:  # already there (a base version without the alias)
        pass
    v = c.create_model_version(
        base, source="s3://ctr-test/never-read", tags={"fingerprint": TEST_BASE_FINGERPRINT, "gate.passed": "true"}
    ).version
    c.set_registered_model_alias(base, "champion", v)
    return TEST_BASE_FINGERPRINT


def adapter_tags(base: str = "ctr_base", **tags) -> dict:
    """`tags` plus the lineage of an adapter trained on the serving `base` (see serving_base_fingerprint).
    On the session's shared tracking server name a base of the test's own: a synthetic `ctr_base@champion`
    there would be the serving base of every later test on that server, and it cannot be loaded."""
    return {"base.name": base, "base.fingerprint": serving_base_fingerprint(base), **tags}


def any_base_policy():
    """A gate policy that passes any base: for the set-up of tests that need *a* serving base, not a
    good one (their bases train one epoch on a few thousand synthetic rows and are no better than
    chance). The base gate itself is tested with the shipped policy (tests/pipelines/flows/test_base.py)."""
    from pipelines.config import GatePolicy

    return GatePolicy(
        min_auc_first_run=0.0,
        min_auc=0.0,
        max_logloss_first_run=1e9,
        auc_tolerance=0.49,
        logloss_tolerance=1e9,
        calibration_min=1e-9,
        calibration_max=1e9,
    )


def kill_at_marker(cmd: list[str], marker: Path, *, what: str, cwd, env: dict, timeout_s: float = 240) -> None:
    """Start `cmd`, wait until it touches `marker` (the point where the crash workers of the fault tests
    stop and sleep), then SIGKILL it: a real process that really dies there, locks and half-done work
    included. Fails the test when the process ends or times out before it gets there."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout_s
    while not marker.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            _, err = proc.communicate()
            pytest.fail(f"{what} never reached {marker.name} (exit {proc.returncode}):\n{err[-3000:]}")
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    proc.communicate()
