"""The champion history is durable: written through an MLflow tracking server, it is all there after
the server is stopped and a new one started on the same store (PostgreSQL when reachable, required
in CI; else SQLite), readable with the MLflow client and with `python -m pipelines history`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient

from pipelines.promotion import aliases
from tests.conftest import adapter_tags, cross_machine_lock_url, free_port, start_mlflow_server, stop_mlflow_server
from tests.pipelines.promotion.test_concurrency import MODEL

REPO = Path(__file__).resolve().parents[3]


def start_server(backend: str, artifacts: Path, port: int):
    artifacts.mkdir(parents=True, exist_ok=True)
    return start_mlflow_server(backend, port, ["--default-artifact-root", str(artifacts)], cwd=artifacts.parent)


@pytest.mark.slow
def test_history_survives_a_restart_of_the_tracking_server(store_uri, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    lock_url = cross_machine_lock_url(store_uri)  # over HTTP, alias moves need a configured lock
    if lock_url is None:
        pytest.skip("no cross-machine registry lock: PostgreSQL and Redis are both unreachable")
    monkeypatch.setenv("CTR_REGISTRY_LOCK_URL", lock_url)
    MlflowClient(tracking_uri=store_uri).search_experiments()  # create the schema once
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(store_uri, tmp_path / "artifacts", port)
    try:
        mlflow.set_tracking_uri(url)
        c = MlflowClient()
        c.create_registered_model(MODEL)
        for _ in range(3):  # a server only takes remote sources without a run; it never downloads them here
            c.create_model_version(
                MODEL, source="s3://ctr-test/never-read", tags=adapter_tags(**{"gate.passed": "true"})
            )
        aliases.promote(MODEL, "1", reason="first", actor="alice")
        aliases.promote(MODEL, "2", reason="better", actor="bob")
        aliases.start_canary(MODEL, "3", 0.1, reason="try v3", actor="bob")
        aliases.revert(MODEL, reason="incident", actor="carol")
        before = aliases.history(MODEL, None)
    finally:
        stop_mlflow_server(server)
    with pytest.raises(OSError):  # the server is really gone
        urllib.request.urlopen(f"{url}/health", timeout=2)

    port2 = free_port()
    server = start_server(store_uri, tmp_path / "artifacts", port2)
    try:
        mlflow.set_tracking_uri(f"http://127.0.0.1:{port2}")
        after = aliases.history(MODEL, None)
        assert after == before and len(after) == 4
        assert [(e["alias"], e["kind"], e["to_version"]) for e in after] == [
            ("champion", "promote", "1"),
            ("champion", "promote", "2"),
            ("canary", "canary", "3"),
            ("champion", "revert", "1"),
        ]
        assert aliases.current(MODEL) == "1" and aliases.current(MODEL, "canary") == "3"
        env = {**os.environ, "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port2}"}
        cli = subprocess.run(
            [sys.executable, "-m", "pipelines", "history", "--model", MODEL],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert cli.returncode == 0, cli.stderr[-2000:]
        lines = [json.loads(line) for line in cli.stdout.splitlines()]
        assert [(e["kind"], e["actor"], e["reason"]) for e in lines] == [
            ("promote", "alice", "first"),
            ("promote", "bob", "better"),
            ("revert", "carol", "incident"),
        ]
    finally:
        mlflow.set_tracking_uri(None)
        stop_mlflow_server(server)
