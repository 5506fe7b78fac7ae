"""A slot's timeline (pipelines.evaluation.timeline): one MLflow run per adapter model whose metrics are series
over days (step = the day), so MLflow's chart view draws the champion's and the candidate's AUC as lines.
Real SQLite store (tests/pipelines/conftest.py: serving_store)."""

from __future__ import annotations

from mlflow import MlflowClient

from pipelines.evaluation import timeline
from tests.pipelines.promotion.test_aliases import add_version

MODEL = "ctr_lora_morning"


def test_a_days_points_carry_the_day_as_step_and_time():
    pts = timeline.points(
        "1998-03-02", {"champion": {"auc": 0.71, "rows": 120, "note": "x"}, "candidate": None}, {"champion": "2"}
    )
    assert {(k, v) for k, v, _, _ in pts} == {
        ("champion_auc", 0.71),
        ("champion_rows", 120.0),
        ("champion_version", 2.0),
    }
    assert {step for *_, step in pts} == {timeline.day_step("1998-03-02")} == {10287}
    assert {ts for _, _, ts, _ in pts} == {888796800000}  # 1998-03-02T00:00Z: MLflow's "Time" axis reads the day


def test_judged_days_make_one_line_per_role_in_one_run(serving_store):
    c = MlflowClient()
    v1, v2 = add_version(MODEL), add_version(MODEL, gate_passed="pending")
    c.set_registered_model_alias(MODEL, "champion", v1)
    run_a = timeline.record(MODEL, "morning", "1998-03-02", [(v2, {"auc": 0.70}), (v1, {"auc": 0.69})])
    c.set_registered_model_alias(MODEL, "champion", v2)  # released: the next day it is the champion
    run_b = timeline.record(MODEL, "morning", "1998-03-03", [(v2, {"auc": 0.72})])
    assert run_a == run_b  # one long-lived run per model
    history = {
        k: [(m.step, m.value) for m in c.get_metric_history(run_a, k)]
        for k in ("champion_auc", "candidate_auc", "champion_version")
    }
    assert history == {
        "champion_auc": [(10287, 0.69), (10288, 0.72)],
        "candidate_auc": [(10287, 0.70)],
        "champion_version": [(10287, float(v1)), (10288, float(v2))],
    }
    run = c.get_run(run_a)
    assert run.info.run_name == f"{MODEL} over days" and run.data.tags["slot"] == "morning"
    assert run.info.status == "FINISHED"
