"""The webhook path: a real `mlflow server` calls `python -m pipelines serve` when an alias moves.

The tracking server is this test's own (SQLite backend: webhooks need a SQL store), started with the
settings docs/runbook.md gives for a serving process on a private network. The serving process polls
only every 600 s here, so a move seen within seconds came through the webhook.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import subprocess
import sys
import time

import mlflow
import pytest
from cryptography.fernet import Fernet

from pipelines.serving.cli import SECRET_ENV, WEBHOOK_NAME
from tests.conftest import free_port, start_mlflow_server, stop_mlflow_server
from tests.pipelines.serving import fixtures
from tests.pipelines.serving.http_server import REPO, serve

pytestmark = pytest.mark.slow
SECRET = "test-webhook-secret"


@pytest.fixture
def webhook_registry(tmp_path, monkeypatch):
    """A fresh `mlflow server` that may call loopback over HTTP, this process pointed at it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_TRACKING", "MLFLOW_REGISTRY"))}
    env.update(
        MLFLOW_WEBHOOK_ALLOWED_SCHEMES="http,https",
        MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS="true",
        MLFLOW_WEBHOOK_SECRET_ENCRYPTION_KEY=Fernet.generate_key().decode(),
        MLFLOW_WEBHOOK_CACHE_TTL="1",
    )  # the server caches each event's webhook list (default 60 s)
    port = free_port()
    proc = start_mlflow_server(
        f"sqlite:///{tmp_path / 'mlflow.db'}",
        port,
        ["--artifacts-destination", str(tmp_path / "artifacts"), "--serve-artifacts"],
        cwd=tmp_path,
        env=env,
    )
    monkeypatch.chdir(tmp_path)
    # An experiment an earlier test of this worker made active (set_experiment exports its id) is not here.
    for k in ("MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_REGISTRY_URI"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(mlflow.tracking.fluent, "_active_experiment_id", None)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    mlflow.set_tracking_uri(f"http://127.0.0.1:{port}")
    try:
        yield fixtures.build()
    finally:
        mlflow.set_tracking_uri(None)
        stop_mlflow_server(proc)


def _register(url: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "pipelines", "serve", "--register-webhook", url],
        env={**os.environ, SECRET_ENV: SECRET, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _signed(body: bytes, secret: str, stamp: int | None = None, delivery: str = "d-1") -> dict:
    stamp = int(time.time()) if stamp is None else stamp
    mac = hmac.new(secret.encode(), f"{delivery}.{stamp}.".encode() + body, hashlib.sha256).digest()
    return {
        "X-MLflow-Delivery-Id": delivery,
        "X-MLflow-Timestamp": str(stamp),
        "X-MLflow-Signature": "v1," + base64.b64encode(mac).decode(),
    }


def test_an_alias_move_is_served_within_seconds_through_the_webhook_and_forged_calls_are_refused(
    webhook_registry, tmp_path
):
    v_new = webhook_registry.adapter("feed", seed=9, alias=None)
    forged = json.dumps(
        {
            "entity": "model_version_alias",
            "action": "created",
            "data": {"name": "ctr_lora_feed", "alias": "champion", "version": "1"},
        }
    ).encode()
    with serve(tmp_path, poll_seconds=600, env={SECRET_ENV: SECRET}) as http:
        hook = _register(http.url + "/webhooks/mlflow")
        assert _register(http.url + "/webhooks/mlflow")["webhook_id"] == hook["webhook_id"]  # idempotent
        time.sleep(1.5)  # past the tracking server's webhook cache
        webhook_registry.set_alias("ctr_lora_feed", "champion", v_new)
        seconds = http.wait_for_route("ctr_lora_feed@champion", f"ctr_lora_feed:{v_new}", timeout_s=30)
        post = lambda headers, body=forged: http.call("/webhooks/mlflow", raw=body, headers=headers)  # noqa: E731
        refused = {
            "unsigned": post({}),
            "wrong secret": post(_signed(forged, "guess")),
            "stale": post(_signed(forged, SECRET, int(time.time()) - 3600)),
            "body changed": post(_signed(forged, SECRET), forged.replace(b'"1"', b'"2"')),
        }
        before = http.call("/routes")[1]["refresh"]["refreshes"]
        good = post(_signed(forged, SECRET, delivery="d-2"))
        replayed = post(_signed(forged, SECRET, delivery="d-2"))
        http.wait_for(lambda: http.call("/routes")[1]["refresh"]["refreshes"] > before)
        metrics = http.call("/metrics")[1]
        routes = http.routes()
    assert hook["name"] == WEBHOOK_NAME
    assert seconds < 30  # polling (600 s) cannot have done it
    assert 'lora_refreshes_total{outcome="ok",trigger="webhook"}' in metrics
    assert {k: status for k, (status, _) in refused.items()} == dict.fromkeys(refused, 401)
    assert "signature does not match" in refused["wrong secret"][1]["message"]
    assert "signature does not match" in refused["body changed"][1]["message"]
    assert "timestamp" in refused["stale"][1]["message"]
    assert good == (200, {"accepted": True}) and replayed[1]["accepted"] is False
    # a webhook is a hint: after the refresh it caused, the route still follows the registry, not the
    # payload naming version 1
    assert routes["ctr_lora_feed@champion"] == f"ctr_lora_feed:{v_new}"
