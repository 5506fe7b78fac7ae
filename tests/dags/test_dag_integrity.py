"""Every DAG file imports without error, quickly, without heavy libraries, with tags and retries."""
from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DAG_FILES = sorted((REPO / "dags").glob("*.py"))
HEAVY = ("torch", "peft", "mlflow", "great_expectations", "sklearn", "pandas")


@pytest.fixture(scope="module")
def dagbag(tmp_path_factory):
    os.environ.setdefault("AIRFLOW_HOME", str(tmp_path_factory.mktemp("airflow_home")))
    os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(REPO / "dags"))


def test_dag_files_exist():
    assert {p.stem for p in DAG_FILES} >= {"ctr_lora_retrain", "ctr_base_model", "ctr_model_ops", "ctr_cold_start"}


def test_no_import_errors(dagbag):
    assert dagbag.import_errors == {}
    assert set(dagbag.dag_ids) >= {"ctr_lora_retrain", "ctr_base_model", "ctr_model_ops", "ctr_cold_start"}


@pytest.mark.parametrize("dag_id", ["ctr_lora_retrain", "ctr_base_model", "ctr_model_ops", "ctr_cold_start"])
def test_tags_retries_docs(dagbag, dag_id):
    dag = dagbag.dags[dag_id]
    assert dag.tags, f"{dag_id} has no tags"
    assert dag.doc_md and len(dag.doc_md) > 80, f"{dag_id} needs a doc_md"
    assert "retries" in dag.default_args, f"{dag_id} sets no default retries"
    assert dag.catchup is False
    for t in dag.tasks:
        assert t.retries is not None


def test_validation_never_retries(dagbag):
    for dag_id in ("ctr_lora_retrain", "ctr_base_model", "ctr_cold_start"):
        assert dagbag.dags[dag_id].get_task("validate").retries == 0


def test_retrain_wiring(dagbag):
    dag = dagbag.dags["ctr_lora_retrain"]
    order = ["validate", "slots", "train_adapter", "evaluate", "register", "gate_and_promote"]
    for up, down in zip(order, order[1:]):
        assert down in dag.get_task(up).downstream_task_ids, f"{up} -> {down} missing"


def test_cold_start_wiring(dagbag):
    dag = dagbag.dags["ctr_cold_start"]
    order = ["validate", "detect", "distill", "evaluate", "register", "gate_and_promote"]
    for up, down in zip(order, order[1:]):
        assert down in dag.get_task(up).downstream_task_ids, f"{up} -> {down} missing"
    assert dag.get_task("register").retries == 0 and dag.get_task("gate_and_promote").retries == 0
    assert set(dag.params) >= {"end_day", "slot", "lake_uri"} and dag.params["slot"] == "all"


@pytest.mark.parametrize("path", DAG_FILES, ids=lambda p: p.name)
def test_parses_fast_without_heavy_imports(path):
    """Parse each file in a fresh interpreter (after Airflow itself is imported) and time it."""
    code = f"""
import sys, time, runpy
import airflow.sdk, pendulum  # the framework's own import cost is not the DAG file's
sys.path.insert(0, {str(REPO / 'plugins')!r})
t = time.perf_counter()
runpy.run_path({str(path)!r})
print(time.perf_counter() - t)
print(",".join(m for m in {HEAVY!r} if m in sys.modules))
"""
    env = {**os.environ, "AIRFLOW__CORE__LOAD_EXAMPLES": "False"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    seconds, heavy = out.stdout.strip().splitlines()[-2:] if out.stdout.strip().count("\n") else (out.stdout.strip(), "")
    assert float(seconds) < 0.5, f"{path.name} took {seconds}s to parse"
    assert heavy == "", f"{path.name} imports heavy modules at parse time: {heavy}"


def test_approval_in_the_policy_adds_a_human_step_before_release(tmp_path):
    """`approval: true` puts Airflow's HITL ApprovalOperator between the gate and the release."""
    policy = tmp_path / "gate.yaml"
    policy.write_text("approval: true\n")
    code = f"""
import sys
sys.path.insert(0, {str(REPO / 'plugins')!r})
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder={str(REPO / 'dags')!r})
assert not bag.import_errors, bag.import_errors
for dag_id in ("ctr_lora_retrain", "ctr_cold_start"):
    dag = bag.dags[dag_id]
    assert "gate_and_promote" not in dag.task_ids
    gate, approve, release = (dag.get_task(f"approval.{{t}}") for t in ("gate_and_promote", "approve_release", "release"))
    assert approve.task_type == "ApprovalOperator", approve.task_type
    assert approve.task_id in gate.downstream_task_ids and release.task_id in approve.downstream_task_ids
    assert release.approval_task_id == approve.task_id and gate.release is False
    assert release.pool == gate.pool == "ctr_registry"
# One group per candidate: gate, approval and release of index i depend on each other only.
assert type(bag.dags["ctr_lora_retrain"].task_group_dict["approval"]).__name__ == "MappedTaskGroup"
print("ok")
"""
    env = {**os.environ, "CTR_GATE_POLICY": str(policy), "AIRFLOW__CORE__LOAD_EXAMPLES": "False"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_default_policy_releases_from_the_gate_task(dagbag):
    dag = dagbag.dags["ctr_lora_retrain"]
    assert "approve_release" not in dag.task_ids and dag.get_task("register").pool == "ctr_registry"
    gate = dag.get_task("gate_and_promote")   # mapped: .partial() must name the pool and the asset alias itself
    assert gate.pool == "ctr_registry" and [o.name for o in gate.outlets] == ["ctr-model-aliases"]


@pytest.mark.parametrize("bad", [
    {"model": "not_a_model", "reason": "a valid reason"},
    {"model": "ctr_lora_feed", "reason": "no"},                        # too short
    {"model": "ctr_lora_feed", "reason": "a valid reason", "version": 0},
    {"model": "ctr_lora_feed", "reason": "a valid reason", "version": "two"},
    {"model": "ctr_lora_feed", "reason": "a valid reason", "action": "delete"},
    {"model": "ctr_lora_feed"},                                        # reason is required
])
def test_model_ops_form_rejects_invalid_input_before_any_task(dagbag, bad):
    from airflow.sdk.definitions.param import ParamValidationError

    params = copy.deepcopy(dagbag.dags["ctr_model_ops"].params)
    with pytest.raises(ParamValidationError):   # raised on assignment or, for a missing value, on validate
        for k, v in bad.items():
            params[k] = v
        params.validate()


def test_model_ops_form_accepts_a_valid_override(dagbag):
    params = copy.deepcopy(dagbag.dags["ctr_model_ops"].params)
    for k, v in {"action": "override", "model": "ctr_lora_feed", "version": 3, "reason": "latency was a blip"}.items():
        params[k] = v
    assert params.validate()["action"] == "override"
    assert set(dagbag.dags["ctr_model_ops"].task_ids) >= {"revert", "promote", "override", "promote_canary",
                                                         "withdraw_canary"}
