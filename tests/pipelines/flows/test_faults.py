"""The slot retrain (train -> evaluate -> register -> gate and release) under faults (issue 13, "Tests that
must exist"): kill -9 (a) right after training and (b) between registration and its alias / model card,
or before the gate recorded its decision; (c) the S3 server gone for 20 s during training's lake reads;
(d) the MLflow tracking server gone for 20 s during evaluation (which loads @champion from the registry).

Real components only: SQLite and PostgreSQL MLflow stores, a real `mlflow server` over HTTP, moto's S3
server over HTTP, real PEFT training in a real child process that really dies. The only fake thing is the
fault: a process stopped at a chosen registry call (crash_retrain.py) or a proxy that drops every
connection for 20 s (outage.py). After each fault: no version serves that did not pass its gate,
@champion is untouched or its move is complete and recorded, the history is one unbroken chain with
nothing pending, and a re-run with the same inputs finishes the work without a second version.
"""

from __future__ import annotations

import os
import pickle
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path
from urllib.parse import unquote

import mlflow
import pytest

from pipelines.config import RegistryConfig, load_gate_policy
from pipelines.data.lake import Lake
from pipelines.data.synthetic import write_days
from pipelines.errors import LakeError
from pipelines.evaluation.compare import evaluate
from pipelines.flows import retrain
from pipelines.promotion import aliases
from pipelines.promotion.release import gate_and_release
from pipelines.registry import history, mlflow_io
from pipelines.registry.register import register
from pipelines.training import adapter, checkpoint
from tests.conftest import kill_at_marker, use_store_copy, validate_lake
from tests.pipelines.flows.outage import Outage
from tests.pipelines.training.helpers import SPEC, registered_base_config

REPO = Path(__file__).resolve().parents[3]
FIRST_DAY, END_DAY = "2024-01-04", "2024-01-05"  # the champion's window, then the candidate's
OUTAGE_S = 20


@pytest.fixture(autouse=True)
def pinned_code_version(monkeypatch):
    """The registration key hashes the code version, which in a checkout with uncommitted edits is a hash
    of the source tree: pinned, so an edit elsewhere in the tree during the test cannot split one
    registration into two keys. The child process inherits it."""
    monkeypatch.setenv("CTR_CODE_VERSION", "test-faults")


def lenient_policy():
    """Every check passes on the tiny lake: the faults are under test here, not the gate. `direct`, so a
    pass moves @champion (the move whose record the invariants check)."""
    return replace(
        load_gate_policy(),
        promotion="direct",
        approval=False,
        superiority=False,
        min_auc_first_run=0.0,
        max_logloss_first_run=50.0,
        auc_tolerance=0.49,
        logloss_tolerance=50.0,
        slot_auc_tolerance=0.49,
        slot_tolerances={},
        max_demographic_parity_gap=1.0,
        max_equalized_odds_gap=1.0,
        calibration_min=0.01,
        calibration_max=100.0,
        latency_budget_ms=60_000.0,
        optional_checks=("fairness", "fairness_dp", "fairness_eo", "calibration", "slot_auc"),
    )


def versions(name: str) -> list[str]:
    """The version ids of `name`, oldest first (as strings: a SQLite store returns ints)."""
    return sorted((str(mv.version) for mv in mlflow_io.client().search_model_versions(f"name = '{name}'")), key=int)


def assert_invariants(name: str, serving: str | None) -> None:
    """@champion is `serving`; whatever serves passed its gate; the champion history is one unbroken
    chain that ends at the serving version, with no move left pending."""
    assert aliases.current(name) == serving
    for alias in ("champion", "canary"):
        mv = mlflow_io.version_by_alias(name, alias)
        assert mv is None or mv.tags.get("gate.passed") == "true", f"v{mv.version} serves as @{alias} ungated"
    chain = aliases.history(name, "champion")
    for before, after in zip(chain, chain[1:]):
        assert after["from_version"] == before["to_version"], f"broken chain: {before} then {after}"
    assert (chain[-1]["to_version"] if chain else None) == serving
    assert history.pending(name) == []


def crowned_first_champion(cfg, lake) -> str:
    """v1 of the feed slot, trained on the window ending FIRST_DAY, gated and serving as @champion."""
    decision = retrain.run(cfg, lenient_policy(), lake, FIRST_DAY, "feed", actor="setup")
    assert decision["passed"] and decision["promoted"] and decision["version"] == "1"
    return decision["version"]


def kill_retrain_at(cfg, lake: str, point: str, tmp: Path) -> None:
    """Run retrain.run for END_DAY in a child process and SIGKILL it at `point` (see crash_retrain)."""
    args, marker = tmp / f"args-{point}.pickle", tmp / f"at-{point}"
    args.write_bytes(pickle.dumps((cfg, lenient_policy(), lake, END_DAY, "feed")))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    kill_at_marker(
        [sys.executable, "-m", "tests.pipelines.flows.crash_retrain", str(args), point, str(marker)],
        marker,
        what="the retrain",
        cwd=os.getcwd(),
        env=env,
    )


# ----------------------------------------------------------------------------- (a), (b): kill -9
@pytest.fixture(scope="module")
def champion_db(template_db, lake, tmp_path_factory):
    """(a SQLite store with the serving base and v1 of the feed slot serving as @champion, its cfg), made
    once per module: each kill test works on a copy (training the base and v1 again would double its time).
    The copies share this store's artifact directory, where every run writes under its own id."""
    d = tmp_path_factory.mktemp("champion-store")
    with pytest.MonkeyPatch.context() as mp:
        use_store_copy(template_db, d, mp)
        mp.setenv(checkpoint.ROOT_ENV, str(d / "ckpt"))
        mp.setenv("CTR_CODE_VERSION", "test-faults")
        cfg = registered_base_config(lake)
        crowned_first_champion(cfg, lake)
        mlflow.set_tracking_uri(None)
    return d / "mlflow.db", cfg


@pytest.fixture
def with_champion(champion_db, tmp_path, monkeypatch):
    """This test's copy of `champion_db`; yields its cfg."""
    use_store_copy(champion_db[0], tmp_path, monkeypatch)
    monkeypatch.setenv(checkpoint.ROOT_ENV, str(tmp_path / "ckpt"))
    yield champion_db[1]
    mlflow.set_tracking_uri(None)


@pytest.mark.slow
@pytest.mark.parametrize("point", ["after_train", "after_register", "before_gate"])
def test_a_retrain_killed_mid_way_is_finished_by_a_rerun(with_champion, lake, tmp_path, point):
    cfg, champion = with_champion, "1"
    name = cfg.adapter_model_name("feed")
    kill_retrain_at(cfg, lake, point, tmp_path)

    # What the dead process left: the champion untouched, nothing ungated serving, the history intact.
    assert_invariants(name, serving=champion)
    left = versions(name)
    runs = mlflow.search_runs(
        experiment_names=[cfg.registry.experiment], output_format="list", filter_string="tags.stage = 'lora_adapter'"
    )
    assert len(runs) == 2 and all(r.outputs.model_outputs for r in runs)  # the killed one logged its adapter
    if point == "after_train":
        assert left == ["1"]  # logged, never registered
    else:
        orphan = mlflow_io.get_version(name, "2")
        assert left == ["1", "2"] and orphan.tags["gate.passed"] == "pending"
        assert orphan.tags["data.last"] == END_DAY and orphan.tags["registration.key"]
        assert ("candidate" in orphan.aliases) is (point == "before_gate")  # alias: the write after the version
        assert bool(orphan.description) is (point == "before_gate")  # card: the write after the alias

    # The re-run (the task's retry, or the next `train-adapter --register`) with the same inputs.
    decision = retrain.run(cfg, lenient_policy(), lake, END_DAY, "feed", actor="rerun")
    assert decision["version"] == "2" and decision["passed"] and decision["promoted"]
    assert versions(name) == ["1", "2"]  # no duplicate version
    done = mlflow_io.get_version(name, "2")
    assert done.tags["gate.passed"] == "true" and "candidate" in done.aliases  # registration completed
    assert done.description.startswith(f"# {name} v2") and "**passed**" in done.description
    assert_invariants(name, serving="2")
    assert [(e["kind"], e["from_version"], e["to_version"], e["actor"]) for e in aliases.history(name)] == [
        ("promote", "", "1", "setup"),
        ("promote", "1", "2", "rerun"),
    ]


# ----------------------------------------------------------------------------- (c): S3 gone during training
def lake_read(method: str, path: str) -> bool:
    """A GET of the lake's partitions (a listing or an object under dt=...)."""
    return method == "GET" and "dt=" in unquote(path)


@pytest.fixture
def s3_lake(s3_bucket, s3_endpoint) -> str:
    """The `lake` fixture's four validated synthetic days, on moto's S3 server."""
    uri = f"s3://{s3_bucket}/clicks"
    write_days(Lake(uri), SPEC, "2024-01-02", 4, 2000)
    validate_lake(uri)
    return uri


@pytest.mark.slow
@pytest.mark.parametrize("attempts", ["library", "3"])
def test_training_rides_out_or_fails_closed_on_a_20s_s3_outage(
    serving_store, s3_lake, s3_endpoint, monkeypatch, attempts
):
    """botocore's standard retries (lake.S3_MAX_ATTEMPTS = 14) wait rand(0,1) * min(0.05 s * 2**i, 20 s)
    before retry i+1: ~53 s in all on average, so one request outlives a 20 s outage all but ~0.2% of
    the time (a simulation of those waits). `library`: the training finishes after the outage, or (the
    unlucky few) fails closed like `3`, which always exhausts its budget inside the outage: a LakeError,
    nothing registered, and the re-run after the outage finishes."""
    cfg = registered_base_config(s3_lake)  # the base trains on S3 directly, before any fault
    name = cfg.adapter_model_name("feed")
    if attempts != "library":
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", attempts)
    with Outage(s3_endpoint, OUTAGE_S) as s3:
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3.url)  # every lake client of the flow goes through it
        s3.arm(lake_read)
        try:
            decision = retrain.run(cfg, lenient_policy(), s3_lake, END_DAY, "feed", actor="outage")
        except LakeError as exc:
            decision = None
            assert "cannot read" in str(exc) or "cannot list" in str(exc), exc
        assert s3.started is not None and s3.faulted  # the outage did hit the training's lake reads
        into_outage = time.monotonic() - s3.started
        if decision is None:  # failed closed: within the outage, and nothing of the run reached the registry
            assert into_outage < OUTAGE_S + 2
            assert versions(name) == [] and history.entries(name) == []
            assert_invariants(name, serving=None)
            s3.end()  # the re-run comes after the outage (an Airflow retry, a person)
            decision = retrain.run(cfg, lenient_policy(), s3_lake, END_DAY, "feed", actor="rerun")
        else:  # rode it out: the reads waited for the server to come back
            assert attempts == "library" and into_outage >= OUTAGE_S
        assert decision["version"] == "1" and decision["passed"] and decision["promoted"]
        assert_invariants(name, serving="1")
        again = retrain.run(cfg, lenient_policy(), s3_lake, END_DAY, "feed", actor="again")  # same inputs
    assert again["version"] == "1" and versions(name) == ["1"]
    assert [(e["kind"], e["from_version"], e["to_version"]) for e in aliases.history(name)] == [("promote", "", "1")]
    assert_invariants(name, serving="1")


# ----------------------------------------------------------------------------- (d): MLflow gone during evaluation
def server_config(lake: str):
    """tests.pipelines.training.helpers.registered_base_config with model and experiment names of this
    test's own (the tracking server is shared by the session), its base registered on the server."""
    tag = uuid.uuid4().hex[:8]
    return registered_base_config(
        lake,
        RegistryConfig(
            base_model_name=f"faults_base_{tag}", adapter_model_prefix=f"faults_lora_{tag}_", experiment=f"faults-{tag}"
        ),
    )


@pytest.mark.slow
def test_evaluation_rides_out_a_20s_tracking_server_outage(on_mlflow_server, lake, tmp_path, monkeypatch):
    """MLflow's client retries every request (mlflow_io.HTTP_RETRY_SETTINGS: 7 retries, backoff factor 2:
    waits 0, 4, 8, 16 s ... so ~28 s of retrying is reached within 4 retries): an evaluation whose first
    registry request meets a 20 s outage loads the candidate and @champion after it and finishes."""
    monkeypatch.setenv(checkpoint.ROOT_ENV, str(tmp_path / "ckpt"))
    with Outage(on_mlflow_server.uri, OUTAGE_S) as server:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", server.url)  # this process reaches the server only through it
        mlflow.set_tracking_uri(server.url)
        cfg = server_config(lake)
        name = cfg.adapter_model_name("feed")
        champion = crowned_first_champion(cfg, lake)
        candidate = adapter.train(cfg, lake, END_DAY, "feed").to_dict()

        server.arm()  # the evaluation's first request (loading the candidate) starts the outage
        started = time.monotonic()
        evaluation = evaluate(cfg, lake, candidate)
        assert server.started is not None and server.faulted and time.monotonic() - started >= OUTAGE_S
        assert evaluation["champion_version"] == champion and evaluation["champion"]["rows"] > 0
        assert versions(name) == ["1"]  # evaluating registers nothing
        assert_invariants(name, serving=champion)

        registered = register(cfg, candidate, evaluation)
        decision = gate_and_release(lenient_policy(), name, registered["version"], evaluation, actor="after-outage")
        assert registered["version"] == "2" and decision["passed"] and decision["promoted"]
        assert_invariants(name, serving="2")
        again = register(cfg, candidate, evaluation)  # the register task's retry, same inputs: no second version
        assert again["existing"] and again["version"] == "2" and versions(name) == ["1", "2"]
        assert [(e["kind"], e["from_version"], e["to_version"]) for e in aliases.history(name)] == [
            ("promote", "", "1"),
            ("promote", "1", "2"),
        ]
        assert_invariants(name, serving="2")
