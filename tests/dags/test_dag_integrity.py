"""Every DAG file imports without error, quickly, without heavy libraries, with tags and retries and the
shared header (ctr_airflow.dag_defaults); the daily DAGs wait for validated data (ctr_lake_arrival's
asset) instead of a clock. The files are discovered, not listed: a new DAG file is covered as it lands."""

from __future__ import annotations

import ast
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DAG_FILES = sorted((REPO / "dags").glob("*.py"))
DAG_IDS = [p.stem for p in DAG_FILES]  # one DAG per file, named after it (test_every_file_is_one_dag)
HEAVY = ("torch", "peft", "mlflow", "great_expectations", "sklearn", "pandas")
# Daily work that reads the day's partition: started by its validation, never by a clock.
ON_VALIDATED_DATA = ("ctr_lora_retrain", "ctr_cold_start", "ctr_champion_monitor")


@pytest.fixture(scope="module")
def dagbag(tmp_path_factory):
    os.environ.setdefault("AIRFLOW_HOME", str(tmp_path_factory.mktemp("airflow_home")))
    os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(REPO / "dags"))


def test_dag_files_exist():
    assert len(DAG_FILES) == 6, DAG_IDS  # a DAG file added or removed: update this count and the docs
    assert set(DAG_IDS) >= {
        "ctr_lora_retrain",
        "ctr_base_model",
        "ctr_model_ops",
        "ctr_cold_start",
        "ctr_champion_monitor",
        "ctr_lake_arrival",
    }


def test_no_import_errors(dagbag):
    assert dagbag.import_errors == {}


def test_every_file_is_one_dag(dagbag):
    """DAG_IDS is derived from the file names: each file defines exactly the DAG it is named after."""
    assert sorted(dagbag.dag_ids) == DAG_IDS
    for dag_id in DAG_IDS:
        assert Path(dagbag.dags[dag_id].fileloc).stem == dag_id


@pytest.mark.parametrize("dag_id", DAG_IDS)
def test_tags_retries_docs(dagbag, dag_id):
    dag = dagbag.dags[dag_id]
    assert dag.tags, f"{dag_id} has no tags"
    assert dag.doc_md and len(dag.doc_md) > 80, f"{dag_id} needs a doc_md"
    assert "retries" in dag.default_args, f"{dag_id} sets no default retries"
    assert dag.catchup is False


@pytest.mark.parametrize("dag_id", DAG_IDS)
def test_every_task_retries_and_every_refusal_fails_at_once(dagbag, dag_id):
    """Every task touches S3 or MLflow: it retries with backoff. What makes a retry useless is a
    deterministic refusal (a PipelineError), which each task turns into a fail-without-retry: Python
    tasks through `ctr_task` (marked `ctr_fail_fast`), the registry operators by their own typed
    AirflowFailException (tests/plugins/ctr_airflow). ctr_model_ops.choose only reads its params."""
    from airflow.providers.standard.operators.hitl import HITLOperator

    from ctr_airflow import operators, sensors

    dag = dagbag.dags[dag_id]
    for t in dag.tasks:
        if t.task_id == "choose" and dag_id == "ctr_model_ops":  # a branch on its params: no I/O
            continue
        assert t.retries >= 2 and t.retry_exponential_backoff > 1, (dag_id, t.task_id, t.retries)
        cls = getattr(t, "operator_class", type(t))  # a mapped task's operator
        fn = getattr(t, "python_callable", None) or (getattr(t, "partial_kwargs", None) or {}).get("python_callable")
        if fn is not None:
            assert getattr(fn, "ctr_fail_fast", False), f"{dag_id}.{t.task_id} is not a ctr_task"
        else:
            assert isinstance(cls, type) and issubclass(
                cls,
                (operators._MoveOperator, operators.GatedPromotionOperator, HITLOperator, sensors.LakePartitionSensor),
            ), (dag_id, t.task_id, cls)


@pytest.mark.parametrize("dag_id", DAG_IDS)
def test_every_dag_has_the_shared_header(dagbag, dag_id):
    from ctr_airflow import dag_defaults

    dag = dagbag.dags[dag_id]
    assert dag.start_date == dag_defaults.START_DATE and dag.catchup is False
    assert dag.owner == dag_defaults.OWNER and dag_defaults.TAG in dag.tags
    assert set(dag.default_args) == {
        "retries",
        "retry_delay",
        "owner",
        "retry_exponential_backoff",
        "max_retry_delay",
        "map_index_template",
    }
    # every mapped task is named by what it works on (the approval step by its model, set in ctr_airflow.approval)
    mapped = [t for t in dag.tasks if t.get_needs_expansion() or getattr(t, "is_mapped", False)]
    assert all(t.map_index_template for t in mapped), [t.task_id for t in mapped if not t.map_index_template]
    assert dag.doc_md == ast.get_docstring(ast.parse(Path(dag.fileloc).read_text()), clean=False)  # the file's own


def test_registry_writes_share_one_pool(dagbag):
    from ctr_airflow.dag_defaults import REGISTRY_POOL

    writers = {(d, t.task_id) for d in DAG_IDS for t in dagbag.dags[d].tasks if t.pool == REGISTRY_POOL}
    assert writers >= {
        ("ctr_base_model", "register"),
        ("ctr_champion_monitor", "monitor"),
        ("ctr_champion_monitor", "auto_revert"),
        ("ctr_cold_start", "register"),
        ("ctr_cold_start", "gate_and_promote"),
        ("ctr_lora_retrain", "register"),
        ("ctr_lora_retrain", "gate_and_promote"),
    }
    assert {t for d, t in writers if d == "ctr_model_ops"} == {
        "revert",
        "promote",
        "override",
        "promote_canary",
        "withdraw_canary",
    }


def test_model_ops_is_wiring_every_action_is_an_operator(dagbag):
    """The form's actions run operators (one library call each); no task body moves an alias itself."""
    from ctr_airflow import operators

    dag = dagbag.dags["ctr_model_ops"]
    choose = dag.get_task("choose")
    assert choose.downstream_task_ids == {"revert", "promote", "override", "promote_canary", "withdraw_canary"}
    for task_id in choose.downstream_task_ids:
        t = dag.get_task(task_id)
        assert isinstance(t, operators._MoveOperator), task_id
        assert t.model == "{{ params.model }}" and t.reason == "{{ params.reason }}"
        assert [o.name for o in t.outlets] == [operators.MOVES.name]


def test_lake_arrival_waits_then_validates_then_announces(dagbag):
    from ctr_airflow.assets import VALIDATED
    from ctr_airflow.sensors import LakePartitionSensor

    dag = dagbag.dags["ctr_lake_arrival"]
    assert set(dag.task_ids) == {"wait_for_partition", "validate"}
    sensor, validate = dag.get_task("wait_for_partition"), dag.get_task("validate")
    assert sensor.downstream_task_ids == {"validate"} and not sensor.upstream_task_ids
    assert isinstance(sensor, LakePartitionSensor)
    # A day that never comes ends skipped (soft_fail), never failed; the slot is free between pokes.
    assert sensor.soft_fail is True and sensor.never_fail is False
    assert sensor.mode == "reschedule" and sensor.reschedule
    assert sensor.poke_interval == 600 and sensor.timeout == 24 * 3600
    assert sensor.wait_timeout_s == "{{ params.wait_timeout_s }}"
    assert [o.name for o in validate.outlets] == [VALIDATED.name] and validate.outlets[0] == VALIDATED
    assert set(dag.params) == {"day", "lake_uri", "wait_timeout_s"}
    assert type(dag.timetable).__name__ == "CronTriggerTimetable" and dag.catchup is False


@pytest.mark.parametrize("dag_id", ON_VALIDATED_DATA)
def test_daily_dags_are_scheduled_on_validated_data(dagbag, dag_id):
    from ctr_airflow.assets import VALIDATED

    dag = dagbag.dags[dag_id]
    assert type(dag.timetable).__name__ == "AssetTriggeredTimetable"
    assert list(dag.schedule) == [VALIDATED]
    assert dag.catchup is False and dag.max_active_runs == 1
    assert "ctr_lake_validated" in dag.doc_md and "ctr_lake_arrival" in dag.doc_md


def test_only_lake_arrival_announces_validated_data_and_only_sensors_wait_on_a_clock(dagbag):
    """The asset has one producer; a DAG on a time schedule starts with a sensor, never with a task
    that reads a partition which may not be there yet (the red run this design removes)."""
    from ctr_airflow.assets import VALIDATED

    producers = [
        (d, t.task_id)
        for d in DAG_IDS
        for t in dagbag.dags[d].tasks
        if any(getattr(o, "name", None) == VALIDATED.name for o in t.outlets)
    ]
    assert producers == [("ctr_lake_arrival", "validate")]
    clocked = [
        d
        for d in DAG_IDS
        if type(dagbag.dags[d].timetable).__name__ not in ("NullTimetable", "AssetTriggeredTimetable")
    ]
    assert clocked == ["ctr_lake_arrival"]
    for dag_id in clocked:
        roots = dagbag.dags[dag_id].roots
        assert roots and all(getattr(t, "_is_sensor", False) for t in roots), dag_id


@pytest.mark.parametrize("dag_id", DAG_IDS)
def test_serialises_for_the_scheduler(dagbag, dag_id):
    """What the DAG processor stores is what the scheduler and workers run: the sensor keeps its mode."""
    from airflow.serialization.serialized_objects import DagSerialization

    dag = DagSerialization.deserialize_dag(DagSerialization.serialize_dag(dagbag.dags[dag_id]))
    assert set(dag.task_ids) == set(dagbag.dags[dag_id].task_ids)
    if dag_id == "ctr_lake_arrival":
        assert dag.get_task("wait_for_partition").reschedule is True


def test_retrain_wiring(dagbag):
    """The shipped config judges on the next days (lora.judged_on: next_day): judge, train, register, hand over,
    gate; the holdout-judged order (gate at registration) is tested below with a config that asks for it."""
    dag = dagbag.dags["ctr_lora_retrain"]
    order = ["validate", "slots", "judge", "train_adapter", "evaluate", "register", "hand_over", "gate_and_promote"]
    for up, down in zip(order, order[1:]):
        assert down in dag.get_task(up).downstream_task_ids, f"{up} -> {down} missing"


def test_retrain_wiring_judged_on_the_holdout(tmp_path):
    """`lora.judged_on: holdout`: train >> evaluate >> register >> gate_and_promote, no judge step."""
    cfg = yaml.safe_load((REPO / "configs" / "pipeline.yaml").read_text())
    cfg["lora"]["judged_on"] = "holdout"
    (tmp_path / "pipeline.yaml").write_text(yaml.safe_dump(cfg))
    code = f"""
import sys
sys.path.insert(0, {str(REPO / "plugins")!r})
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder={str(REPO / "dags")!r})
assert not bag.import_errors, bag.import_errors
dag = bag.dags["ctr_lora_retrain"]
order = ["validate", "slots", "train_adapter", "evaluate", "register", "gate_and_promote"]
for up, down in zip(order, order[1:]):
    assert down in dag.get_task(up).downstream_task_ids, (up, down)
assert "judge" not in dag.task_ids and "hand_over" not in dag.task_ids
print("ok")
"""
    env = {
        **os.environ,
        "CTR_PIPELINE_CONFIG": str(tmp_path / "pipeline.yaml"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
    }
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_cold_start_wiring(dagbag):
    dag = dagbag.dags["ctr_cold_start"]
    order = ["validate", "detect", "distill", "evaluate", "register", "gate_and_promote"]
    for up, down in zip(order, order[1:]):
        assert down in dag.get_task(up).downstream_task_ids, f"{up} -> {down} missing"
    assert set(dag.params) >= {"end_day", "slot", "lake_uri"} and dag.params["slot"] == "all"


@pytest.mark.parametrize("path", DAG_FILES, ids=lambda p: p.name)
def test_parses_fast_without_heavy_imports(path):
    """Parse each file in a fresh interpreter (after Airflow itself is imported) and time it."""
    code = f"""
import sys, time, runpy
import airflow.sdk, pendulum  # the framework's own import cost is not the DAG file's
sys.path.insert(0, {str(REPO / "plugins")!r})
t = time.perf_counter()
runpy.run_path({str(path)!r})
print(time.perf_counter() - t)
print(",".join(m for m in {HEAVY!r} if m in sys.modules))
"""
    env = {**os.environ, "AIRFLOW__CORE__LOAD_EXAMPLES": "False"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    seconds, heavy = (
        out.stdout.strip().splitlines()[-2:] if out.stdout.strip().count("\n") else (out.stdout.strip(), "")
    )
    assert float(seconds) < 0.5, f"{path.name} took {seconds}s to parse"
    assert heavy == "", f"{path.name} imports heavy modules at parse time: {heavy}"


def test_approval_in_the_policy_adds_a_human_step_before_release(tmp_path):
    """`approval: true` puts Airflow's HITL ApprovalOperator between the gate and the release."""
    policy = tmp_path / "gate.yaml"
    policy.write_text("approval: true\n")
    code = f"""
import sys
sys.path.insert(0, {str(REPO / "plugins")!r})
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder={str(REPO / "dags")!r})
assert not bag.import_errors, bag.import_errors
for dag_id in ("ctr_lora_retrain", "ctr_cold_start"):
    dag = bag.dags[dag_id]
    assert "gate_and_promote" not in dag.task_ids
    names = ("gate_and_promote", "approve_release", "release")
    gate, approve, release = (dag.get_task(f"approval.{{t}}") for t in names)
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


@pytest.mark.parametrize("approval", [False, True], ids=["released-by-the-gate", "with-approval"])
def test_judged_on_next_day_judges_then_releases_then_trains(tmp_path, approval):
    """`lora.judged_on: next_day`: validate >> slots >> judge yesterday's candidates >> train today's >> evaluate >>
    register >> hand_over what the judge let go >> gate (or the approval group); nothing is gated at registration."""
    cfg = yaml.safe_load((REPO / "configs" / "pipeline.yaml").read_text())
    cfg["lora"]["judged_on"] = "next_day"
    (tmp_path / "pipeline.yaml").write_text(yaml.safe_dump(cfg))
    (tmp_path / "gate.yaml").write_text(f"approval: {str(approval).lower()}\n")
    code = f"""
import sys
sys.path.insert(0, {str(REPO / "plugins")!r})
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder={str(REPO / "dags")!r})
assert not bag.import_errors, bag.import_errors
dag = bag.dags["ctr_lora_retrain"]
down = lambda t: dag.get_task(t).downstream_task_ids
assert down("slots") >= {{"judge", "train_adapter"}} and down("judge") == {{"train_adapter"}}
assert down("train_adapter") == {{"evaluate"}} and down("evaluate") == {{"register"}}
assert down("register") == {{"hand_over"}}, down("register")
gate = "approval.gate_and_promote" if {approval} else "gate_and_promote"
assert down("hand_over") == {{gate}} and dag.get_task(gate).pool == dag.get_task("judge").pool == "ctr_registry"
print("ok")
"""
    env = {
        **os.environ,
        "CTR_PIPELINE_CONFIG": str(tmp_path / "pipeline.yaml"),
        "CTR_GATE_POLICY": str(tmp_path / "gate.yaml"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
    }
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


@pytest.mark.parametrize(
    "content",
    [None, "approval: [true\n", "approval: true\napprovals: false\n", "approval: maybe\n"],
    ids=["missing", "not-yaml", "unknown-key", "wrong-type"],
)
def test_a_policy_that_cannot_be_read_fails_the_import_visibly(tmp_path, content):
    """Issue 13: a broken policy file is an import error of the DAGs whose shape depends on it (the UI
    shows it), never a silently different DAG without the approval step. The other DAGs still load."""
    policy = tmp_path / "gate.yaml"
    if content is not None:
        policy.write_text(content)
    code = f"""
import json, sys
sys.path.insert(0, {str(REPO / "plugins")!r})
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder={str(REPO / "dags")!r})
print(json.dumps({{"errors": {{k.rsplit("/", 1)[-1]: v for k, v in bag.import_errors.items()}},
                  "dags": sorted(bag.dag_ids)}}))
"""
    env = {**os.environ, "CTR_GATE_POLICY": str(policy), "AIRFLOW__CORE__LOAD_EXAMPLES": "False"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]

    bag = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(bag["errors"]) == {"ctr_base_model.py", "ctr_lora_retrain.py", "ctr_cold_start.py"}, bag["errors"]
    for error in bag["errors"].values():
        assert "ConfigError" in error and str(policy) in error
    assert "ctr_lora_retrain" not in bag["dags"] and "ctr_model_ops" in bag["dags"]


def test_default_policy_releases_from_the_gate_task(dagbag):
    dag = dagbag.dags["ctr_lora_retrain"]
    assert "approve_release" not in dag.task_ids and dag.get_task("register").pool == "ctr_registry"
    gate = dag.get_task("gate_and_promote")  # mapped: .partial() must name the pool and the asset alias itself
    assert gate.pool == "ctr_registry" and [o.name for o in gate.outlets] == ["ctr-model-aliases"]


@pytest.mark.parametrize(
    "bad",
    [
        {"model": "not_a_model", "reason": "a valid reason"},
        {"model": "ctr_lora_feed", "reason": "no"},  # too short
        {"model": "ctr_lora_feed", "reason": "a valid reason", "version": 0},
        {"model": "ctr_lora_feed", "reason": "a valid reason", "version": "two"},
        {"model": "ctr_lora_feed", "reason": "a valid reason", "action": "delete"},
        {"model": "ctr_lora_feed"},  # reason is required
        {"model": "ctr_lora_feed", "reason": "x" * 2000},  # over the library's limit
    ],
)
def test_model_ops_form_rejects_invalid_input_before_any_task(dagbag, bad):
    from airflow.sdk.definitions.param import ParamValidationError

    params = copy.deepcopy(dagbag.dags["ctr_model_ops"].params)
    with pytest.raises(ParamValidationError):  # raised on assignment or, for a missing value, on validate
        for k, v in bad.items():
            params[k] = v
        params.validate()


def test_model_ops_renders_its_form_as_text(dagbag):
    """A native rendering turns a reason "12345" into an int (issue 13); the operators coerce text."""
    assert dagbag.dags["ctr_model_ops"].render_template_as_native_obj is False


def test_model_ops_form_accepts_a_valid_override(dagbag):
    params = copy.deepcopy(dagbag.dags["ctr_model_ops"].params)
    for k, v in {"action": "override", "model": "ctr_lora_feed", "version": 3, "reason": "latency was a blip"}.items():
        params[k] = v
    assert params.validate()["action"] == "override"
    assert set(dagbag.dags["ctr_model_ops"].task_ids) >= {
        "revert",
        "promote",
        "override",
        "promote_canary",
        "withdraw_canary",
    }
