"""End to end through a real Airflow DAG run of `ctr_cold_start` (`airflow dags test`) on MovieLens in
moto's S3, with PostgreSQL metadata stores when reachable (else SQLite).

Set-up in-process (faster than running the other DAGs): the serving base `ctr_base@champion` trained
up to 1997-12-31, and one slot champion (`ctr_lora_morning`) as a teacher; the other slots' teacher
is the base. Then the DAG run: validate -> detect -> distill -> evaluate -> register -> gate."""

from __future__ import annotations

import datetime as dt
import json

import mlflow
import pytest
from mlflow import MlflowClient

from pipelines.config import load_pipeline_config
from pipelines.data.lake import Lake
from pipelines.evaluation.compare import evaluate
from pipelines.flows.base import register_base
from pipelines.promotion import aliases
from pipelines.promotion.aliases import current, history
from pipelines.registry.register import register
from pipelines.training import adapter, base_model
from pipelines.validation.stage import validate_window
from tests.conftest import any_base_policy
from tests.e2e.stack import Stack, make_env, metadata_stores, movielens_lake, this_process_on

pytestmark = pytest.mark.slow

CUTOFF, TEACHER_DAY, DAY = "1997-12-31", "1998-03-01", "1998-03-02"
BUCKET = "e2e-cold-lake"
LAKE_URI = f"s3://{BUCKET}/clicks"


def lake_days(lake_uri: str, last: str = DAY, days: int | None = None) -> int:
    """How many committed partitions the `days` days ending at `last` hold (all of the lake without `days`)."""
    present = Lake(lake_uri).list_partitions()
    if days is None:
        return (dt.date.fromisoformat(last) - dt.date.fromisoformat(present[0])).days + 1
    first = (dt.date.fromisoformat(last) - dt.timedelta(days=days - 1)).isoformat()
    return sum(first <= d <= last for d in present)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, s3_endpoint):
    tmp = tmp_path_factory.mktemp("e2e-cold")
    lake_uri, config_path = movielens_lake(tmp, BUCKET, DAY, cold_start={"window_days": 45, "history_days": 60})
    artifact_root = f"s3://{BUCKET}/mlflow"
    with metadata_stores(tmp) as (airflow_conn, mlflow_uri, kind):
        st = Stack(make_env(tmp, airflow_conn, mlflow_uri, config_path, artifact_root), kind, tmp)
        st.init_airflow()
        with this_process_on(mlflow_uri, CTR_MLFLOW_ARTIFACT_ROOT=artifact_root, CTR_PIPELINE_CONFIG=str(config_path)):
            cfg = load_pipeline_config()
            # every day the set-up and the run read is validated first, as the DAGs' validate tasks do
            assert validate_window(cfg, lake_uri, DAY, lake_days(lake_uri))["success"]
            register_base(cfg, base_model.train(cfg, lake_uri, CUTOFF), actor="e2e", policy=any_base_policy())
            cand = adapter.train(cfg, lake_uri, TEACHER_DAY, "morning").to_dict()
            reg = register(cfg, cand, evaluate(cfg, lake_uri, cand))
            aliases.move_alias(
                reg["model"],
                "champion",
                reg["version"],
                kind="promote",
                actor="e2e",
                reason="e2e: the teacher of the morning slot",
            )
            yield st


def test_cold_start_dag_distills_evaluates_registers_and_gates(stack):
    proc = stack.airflow("dags", "test", "ctr_cold_start", DAY)
    out = proc.stdout + proc.stderr
    # the history and the window: detection counts impressions in the history, so all of it is validated
    assert f", {lake_days(LAKE_URI, last=DAY, days=45 + 60)} partitions ending {DAY}" in out
    assert "held-out cold users: slot champions AUC" in out and "| baseline AUC" in out and "| student AUC" in out
    assert "gate PASSED" in out or "gate REJECTED" in out

    c = MlflowClient()
    (mv,) = c.search_model_versions("name = 'ctr_lora_cold_start'")
    base = c.get_model_version_by_alias("ctr_base", "champion")
    for tag in (
        "data.first",
        "data.last",
        "data.partitions",
        "data.sha256",
        "config.hash",
        "code.version",
        "base.name",
        "base.version",
        "base.fingerprint",
        "training.run_id",
    ):
        assert mv.tags.get(tag), f"ctr_lora_cold_start v1 lacks lineage tag {tag}"
    assert mv.tags["base.fingerprint"] == base.tags["fingerprint"] and mv.tags["data.last"] == DAY
    assert mv.tags["cold_start.cutoff"] == CUTOFF and mv.tags["slot"] == "all"
    assert json.loads(mv.tags["cold_start.teachers"]) == {
        "morning": "ctr_lora_morning v1",
        "afternoon": "ctr_base v1",
        "night": "ctr_base v1",
    }
    # the gate ran and recorded its decision; first run: absolute thresholds; the alias follows it
    assert mv.tags["gate.passed"] in ("true", "false") and mv.tags["gate.first_run"] == "true"
    passed = mv.tags["gate.passed"] == "true"
    assert current("ctr_lora_cold_start") == ("1" if passed else None)
    moves = [(h["kind"], h["to_version"]) for h in history("ctr_lora_cold_start")]
    assert moves == ([("promote", "1")] if passed else [])

    # AUC and logloss of teacher, baseline and student on the held-out cold users, on the student's run
    run = c.get_run(mv.run_id)
    m = run.data.metrics
    for who in ("champions", "baseline", "student", "base"):
        assert 0.5 < m[f"eval_{who}_auc"] < 1.0 and 0.0 < m[f"eval_{who}_logloss"] < 1.0, who
    assert m["eval_student_auc"] == m["eval_candidate_auc"]
    assert m["rows_holdout"] >= 100 and m["cold_new_users"] > 0
    assert run.data.tags["stage"] == "cold_start" and run.data.tags["base.cutoff"] == CUTOFF
    assert run.data.tags["teacher.kind"] in ("champions", "base")
    assert mv.tags["cold_start.teacher"] == run.data.tags["teacher.kind"]
    evaluation = json.loads(mlflow.artifacts.load_text(f"runs:/{mv.run_id}/cold_start/evaluation.json"))
    assert evaluation["holdout_rows"] == m["rows_holdout"] and evaluation["teacher_saw_holdout"] == ["morning"]
    # the window was validated first, like the retrain DAG's
    runs = mlflow.search_runs(
        experiment_names=["ctr-data-validation"], filter_string=f"tags.end_day = '{DAY}'", output_format="list"
    )
    assert len(runs) == 1 and runs[0].data.tags["success"] == "True"


def test_ui_trigger_with_params_runs_one_slot(stack):
    """As triggered from the UI form: end_day and a single slot (a model of its own, teacher: that slot's)."""
    conf = json.dumps({"end_day": DAY, "slot": "morning"})
    stack.airflow("dags", "test", "ctr_cold_start", "-c", conf)
    (mv,) = MlflowClient().search_model_versions("name = 'ctr_lora_cold_start_morning'")
    assert mv.tags["slot"] == "morning" and mv.tags["data.last"] == DAY
    assert json.loads(mv.tags["cold_start.teachers"]) == {"morning": "ctr_lora_morning v1"}
    assert mv.tags["gate.passed"] in ("true", "false")
    evaluation = json.loads(mv.tags["cold_start.eval"])
    assert set(evaluation) == {"champions", "baseline", "student", "base"}
    holdout_rows = int(MlflowClient().get_run(mv.run_id).data.metrics["rows_holdout"])
    assert {m["rows"] for m in evaluation.values()} == {holdout_rows}
