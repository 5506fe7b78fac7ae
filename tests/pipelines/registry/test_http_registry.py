"""Every registry operation works against a real `mlflow server` over HTTP (issue 11): PostgreSQL backend,
artifacts proxied by the server to S3 (moto), clients that know nothing but MLFLOW_TRACKING_URI (and
CTR_REGISTRY_LOCK_URL to move aliases).

* the issue's reproduction, as the CLI: `generate` + `train-base --register` registers the logged model
  (`models:/m-…` plus its model id), sets ctr_base@champion, records the move, and its artifacts are
  in the bucket behind the server; a fresh process loads and scores `models:/ctr_base@champion`.
  Without CTR_REGISTRY_LOCK_URL it is refused before anything is registered;
* the adapter lifecycle: registration with lineage tags and the model card, gate, canary, promote,
  revert, the history in `ctr-alias-history`, and `models:/<adapter>@champion` loaded in a fresh
  process (its base looked up through the server) predicting what this process predicts.

The fresh-process load and the lineage checks of test_trust.py run over HTTP too (parametrised).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from dataclasses import replace
from pathlib import Path

import boto3
import mlflow
import numpy as np
import pytest
import yaml
from mlflow import MlflowClient

from pipelines.config import GatePolicy, RegistryConfig, to_dict
from pipelines.data.lake import Lake, concat
from pipelines.evaluation.compare import evaluate
from pipelines.promotion import aliases, gate_record
from pipelines.registry import history, mlflow_io
from pipelines.registry import register as reg
from pipelines.training import adapter, checkpoint
from tests.conftest import any_base_policy
from tests.pipelines.registry.test_trust import END_DAY, _fresh_process_predict
from tests.pipelines.training.helpers import registered_base_config

REPO = Path(__file__).resolve().parents[3]
# The gate's record is what matters here, not its bar (a tiny lake, one epoch).
LENIENT = GatePolicy(
    min_auc_first_run=0.5,
    max_logloss_first_run=5.0,
    calibration_min=0.01,
    calibration_max=100.0,
    max_demographic_parity_gap=1.0,
    max_equalized_odds_gap=1.0,
    latency_budget_ms=1e6,
    optional_checks=("fairness_dp", "fairness_eo"),
)


def bucket_keys(server, location: str) -> list[str]:
    """The S3 keys behind an artifact location of the server (mlflow-artifacts:/<path>)."""
    assert location.startswith("mlflow-artifacts:/"), location  # proxied, not a client-side S3 URI
    bucket, root = server.artifacts.removeprefix("s3://").split("/", 1)
    prefix = f"{root}/{location.removeprefix('mlflow-artifacts:/').lstrip('/')}"
    pages = boto3.client("s3").get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return [o["Key"].removeprefix(prefix).lstrip("/") for page in pages for o in page.get("Contents", [])]


def client_env(server) -> dict:
    """What a client on another machine has: the tracking URI, the lock URL; no S3 endpoint or credentials,
    no CTR_MLFLOW_ARTIFACT_ROOT (experiments use the server's default mlflow-artifacts:/ location)."""
    drop = ("AWS_", "MLFLOW_", "CTR_MLFLOW_ARTIFACT_ROOT", "CTR_REGISTRY_LOCK_URL")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    return {
        **env,
        "MLFLOW_TRACKING_URI": server.uri,
        "CTR_REGISTRY_LOCK_URL": server.lock_url or "",
        "CTR_TORCH_THREADS": "1",
        "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
    }


def cli(args: list[str], env: dict, cwd: Path, ok: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "pipelines", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    assert (proc.returncode == 0) is ok, (proc.stdout + proc.stderr)[-4000:]
    return proc


def printed(proc: subprocess.CompletedProcess) -> dict:
    """The JSON document the CLI printed last (MLflow prints its run links on stdout too)."""
    out = proc.stdout
    return json.loads(out[out.rindex("\n{\n") + 1 :] if "\n{\n" in out else out[out.index("{") :])


@pytest.mark.slow
def test_the_issue_reproduction_registers_ctr_base_champion_over_http(on_mlflow_server, tmp_path):
    server = on_mlflow_server
    env = client_env(server)
    lake = tmp_path / "LAKE"
    cli(
        [
            "generate",
            "--source",
            "synthetic",
            "--out",
            str(lake),
            "--days",
            "4",
            "--rows-per-day",
            "3000",
            "--seed",
            "1",
        ],
        env,
        tmp_path,
    )

    policy = tmp_path / "any_base.yaml"  # the synthetic base is no better than chance: this test is about HTTP
    policy.write_text(yaml.safe_dump(to_dict(any_base_policy())))
    # A base name of this test's own: the session's server is shared, and another test's base (its
    # artifacts in S3, which this client has no credentials for) would be the serving base to beat.
    name = f"ctr_base_{uuid.uuid4().hex[:8]}"
    config = yaml.safe_load((REPO / "configs" / "synthetic.yaml").read_text())
    config.setdefault("registry", {})["base_model_name"] = name
    (tmp_path / "pipeline.yaml").write_text(yaml.safe_dump(config))
    train_base = ["train-base", "--cutoff", "2026-01-02", "--data", str(lake), "--register", "--policy", str(policy)]
    env = {**env, "CTR_PIPELINE_CONFIG": str(tmp_path / "pipeline.yaml"), "CTR_CHECKPOINT_ROOT": str(tmp_path / "ckpt")}
    c = MlflowClient()
    refused = cli(train_base, {**env, "CTR_REGISTRY_LOCK_URL": ""}, tmp_path, ok=False)  # no lock over HTTP
    assert "set CTR_REGISTRY_LOCK_URL" in refused.stderr
    assert c.search_model_versions(f"name = '{name}'") == []  # nothing registered
    out = printed(cli(train_base, env, tmp_path))

    mv = c.get_model_version_by_alias(name, "champion")
    assert (str(mv.version), out["model"], out["moved"]) == (out["version"], name, True)
    assert mv.tags["fingerprint"] == out["fingerprint"] and mv.tags["gate.passed"] == "true"
    assert mv.source.startswith("models:/m-")  # the logged model, not a copy
    logged = c.get_logged_model(mv.source.removeprefix("models:/"))
    assert logged.source_run_id == mv.run_id
    assert mv.run_id and c.get_run(mv.run_id).data.tags["data.cutoff"] == "2026-01-02"
    last = aliases.history(name)[-1]
    assert (last["kind"], last["to_version"]) == ("promote", out["version"])
    assert last["reason"] == "base passed gate (first base); adapters this base makes incompatible (retrain them): none"
    stored = bucket_keys(server, logged.artifact_location)  # the weights went through to S3
    assert {"MLmodel", "artifacts/meta.json", "artifacts/base/weights.safetensors"} <= set(stored)
    exp = mlflow.get_experiment_by_name(history.HISTORY_EXPERIMENT)
    assert exp.artifact_location.startswith("mlflow-artifacts:/")

    rows = concat(Lake(str(lake)).read_window("2026-01-04", 1)).head(200).reset_index(drop=True)
    here = mlflow.pyfunc.load_model(f"models:/{name}/{mv.version}").predict(rows)
    fresh = _fresh_process_predict(f"models:/{name}@champion", rows, tmp_path)
    np.testing.assert_allclose(fresh, here, rtol=0, atol=1e-6)


@pytest.fixture
def own_names(on_mlflow_server, lake, tmp_path, monkeypatch):
    """The small lake's config (the settings of tests/pipelines/training/helpers.py: registered_base_config)
    under model names of this test's own, its base registered as <base>@champion on the shared server."""
    monkeypatch.setenv(checkpoint.ROOT_ENV, str(tmp_path / "ckpt"))
    tag = uuid.uuid4().hex[:8]
    return registered_base_config(
        lake, RegistryConfig(base_model_name=f"ctr_base_{tag}", adapter_model_prefix=f"ctr_lora_{tag}_")
    )


def _candidate(cfg, lake: str, seed: int) -> dict:
    """Train, evaluate, register (alias candidate) and gate one adapter of slot feed; returns the registration."""
    c = replace(cfg, lora=replace(cfg.lora, seed=seed))
    cand = adapter.train(c, lake, END_DAY, "feed").to_dict()
    out = reg.register(c, cand, evaluate(c, lake, cand))
    assert gate_record.run(LENIENT, out["model"], out["version"], out["evaluation"], actor="test")["passed"]
    return {**out, "model_uri": cand["model_uri"], "run_id": cand["run_id"]}


@pytest.mark.slow
def test_adapters_registered_promoted_and_reverted_over_http_serve_from_a_fresh_process(own_names, lake, tmp_path):
    cfg = own_names
    first, second = _candidate(cfg, lake, seed=7), _candidate(cfg, lake, seed=8)
    model = first["model"]
    assert (first["existing"], second["existing"], second["version"]) == (False, False, "2")
    mv = mlflow_io.get_version(model, "1")
    assert mv.tags["base.name"] == cfg.registry.base_model_name and mv.tags["gate.passed"] == "true"
    assert mv.description.startswith(f"# {model} v1") and "**passed**" in mv.description  # the model card
    assert mlflow_io.version_by_alias(model, "candidate").version == "2"
    assert "model_card/v1.md" in {a.path for a in mlflow_io.client().list_artifacts(first["run_id"], "model_card")}

    aliases.promote(model, "1", reason="first champion", actor="alice", op_id="t-1")
    aliases.start_canary(model, "2", 0.25, reason="try v2", actor="bob", op_id="t-2")
    aliases.promote_canary(model, reason="healthy canary", actor="bob", op_id="t-3")
    assert aliases.promote(model, "2", reason="again", actor="bob", op_id="t-3")["moved"] is False  # replay
    back = aliases.revert(model, reason="incident", actor="carol", op_id="t-4")
    assert (back["moved"], back["from_version"], back["to_version"]) == (True, "2", "1")
    assert [(e["alias"], e["kind"], e["from_version"], e["to_version"]) for e in aliases.history(model, None)] == [
        ("champion", "promote", "", "1"),
        ("canary", "canary", "", "2"),
        ("champion", "promote", "1", "2"),
        ("canary", "withdraw", "2", ""),
        ("champion", "revert", "2", "1"),
    ]
    assert aliases.current(model) == "1" and aliases.current(model, "canary") is None
    assert mlflow_io.get_version(model, "2").tags[aliases.CANARY_SHARE_TAG] == "0.25"

    rows = concat(Lake(lake).read_window(END_DAY, 1)).head(300).reset_index(drop=True)
    v1 = mlflow.pyfunc.load_model(first["model_uri"]).predict(rows)  # this process, by logged-model id
    v2 = mlflow.pyfunc.load_model(second["model_uri"]).predict(rows)
    assert np.abs(np.asarray(v1) - np.asarray(v2)).max() > 1e-5  # which version serves is visible
    fresh = _fresh_process_predict(f"models:/{model}@champion", rows, tmp_path)  # knows only the tracking URI
    np.testing.assert_allclose(fresh, v1, rtol=0, atol=1e-6)
