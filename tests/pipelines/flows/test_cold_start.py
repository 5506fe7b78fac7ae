"""The cold-start flow end to end (the CLI's `cold-start`): detect -> distill -> evaluate -> register ->
gate, twice on the same data, against a real SQLite MLflow store with a serving base and a slot champion."""

from __future__ import annotations

import json
from dataclasses import replace

import pandas as pd
import pytest
from mlflow import MlflowClient

from pipelines.config import load_gate_policy
from pipelines.data.synthetic import generate_day
from pipelines.errors import PromotionError
from pipelines.flows import cold_start as cold_start_flow
from pipelines.flows.base import register_base
from pipelines.model import family
from pipelines.promotion import aliases
from pipelines.registry import integrity, pyfunc
from pipelines.training import base_model
from tests.conftest import any_base_policy, use_store_copy
from tests.pipelines.model.text_source import family_config
from tests.pipelines.training.cold_start_helpers import (
    BASE_DAY,
    END_DAY,
    make_champion,
    promote_teacher,
    serving_base_config,
    tiny_config,
)
from tests.pipelines.training.cold_start_helpers import cold_cfg, cold_lake  # noqa: F401  (fixtures `cfg`, `lake`)
from tests.pipelines.training.helpers import CFG, SPEC


def test_stage_detects_distills_evaluates_registers_and_gates(cfg, lake):
    promote_teacher(cfg, lake, "feed")
    policy = load_gate_policy()
    first = cold_start_flow.run_all(cfg, lake, END_DAY, policy=policy, actor="test")
    json.dumps(first)  # JSON-safe all the way down

    det = first["detected"]
    assert det["cutoff"] == BASE_DAY and det["window"] == {"first": "2024-01-05", "last": END_DAY}
    assert det["cold"]["new_users"] > 0 and det["rows"]["labelled"] >= 50 and det["rows"]["holdout"] >= 50
    assert det["data"]["first"] == "2024-01-02" and det["data"]["count"] == 8  # history + window read

    ev = first["evaluation"]
    assert first["model"] == "ctr_lora_cold_start" and first["version"] == "1"
    assert set(ev["cold_slice"]) == {"champions", "baseline", "student", "base"}
    assert ev["teacher"] in ("champions", "base") and ev["teacher"] == first["evaluation"]["teacher"]
    for m in ev["cold_slice"].values():
        assert 0.0 < m["auc"] < 1.0 and m["logloss"] > 0 and m["rows"] == det["rows"]["holdout"]
    # the student is the gate's candidate, judged like any adapter (tests/pipelines/evaluation/test_cold_start.py)
    assert {k: ev["candidate"][k] for k in ev["cold_slice"]["student"]} == ev["cold_slice"]["student"]
    assert ev["champion"] is None and ev["candidate"]["gauc"] is not None
    assert set(ev["report"]["fairness"]) == {"gender", "age_bucket"} and ev["latency"]["batch_32"]["p99_ms"] > 0
    assert first["gate"]["first_run"] is True

    c = MlflowClient()
    mv = c.get_model_version("ctr_lora_cold_start", "1")
    for tag in (
        "data.first",
        "data.last",
        "data.sha256",
        "config.hash",
        "base.name",
        "base.version",
        "base.fingerprint",
        "training.run_id",
        "cold_start.cutoff",
        "cold_start.holdout_start",
    ):
        assert mv.tags.get(tag), tag
    assert json.loads(mv.tags["cold_start.teachers"]) == {
        "feed": "ctr_lora_feed v1",
        "search": "ctr_base v1",
        "splash": "ctr_base v1",
    }
    assert mv.tags["gate.passed"] == ("true" if first["gate"]["passed"] else "false")
    run = c.get_run(mv.run_id)
    for who in ("champions", "baseline", "student", "base"):
        for k in ("auc", "logloss"):
            assert run.data.metrics[f"eval_{who}_{k}"] == pytest.approx(ev["cold_slice"][who][k])
    assert run.data.tags["stage"] == "cold_start" and run.data.tags["teacher.feed"] == "ctr_lora_feed v1"
    assert run.data.tags["teacher.kind"] == mv.tags["cold_start.teacher"] == ev["teacher"]
    assert {"teacher_labelled_logloss_champions", "teacher_labelled_logloss_base"} <= set(run.data.metrics)
    assert run.data.params["cold_start.w_kd"] == str(cfg.cold_start.w_kd)
    arts = {a.path for a in c.list_artifacts(mv.run_id)}
    assert {"baseline_adapter", "cold_start", "lineage"} <= arts

    # Same day again: the same seed, data, config and code give the same student: registration returns v1
    # instead of a duplicate, and it is gated against the champion (itself) on the same rows.
    if not first["gate"]["passed"]:
        make_champion("ctr_lora_cold_start", "1")
    second = cold_start_flow.run_all(cfg, lake, END_DAY, policy=policy, actor="test")
    ev2 = second["evaluation"]
    assert second["version"] == "1" and ev2["champion_version"] == "1" and second["gate"]["first_run"] is False
    assert len(c.search_model_versions("name = 'ctr_lora_cold_start'")) == 1
    assert ev2["cold_slice"] == ev["cold_slice"]  # deterministic
    assert ev2["champion"]["auc"] == ev2["candidate"]["auc"]  # v1 scored on the same rows: identical
    assert second["detected"] == det


def test_the_cli_flow_cannot_release_a_student_past_a_required_approval(cfg, lake):
    """`python -m pipelines cold-start` runs run_all in one process: with `approval: true` the student is
    registered and gated, and its release is refused (issue 13); the champion keeps serving."""
    # This tiny data's AUC is near 0.5, under any first-run floor and the every-run floor (min_auc): serve a
    # first student, then gate a second one (another config: another version) against it with wide
    # tolerances (per slot too) and no floor. Its
    # held-out rows have no age bucket and not every slot with enough rows to measure: those checks
    # optional here; the latency is measured, under a budget wide enough for a busy test machine.
    first = cold_start_flow.run_all(cfg, lake, END_DAY, policy=load_gate_policy(), actor="cli")
    make_champion(first["model"], first["version"])
    policy = replace(
        load_gate_policy(),
        approval=True,
        promotion="direct",
        auc_tolerance=0.49,
        min_auc=0.0,
        slot_auc_tolerance=0.49,
        logloss_tolerance=10.0,
        calibration_min=0.01,
        calibration_max=100.0,
        latency_budget_ms=60_000.0,
        optional_checks=("fairness_dp", "fairness_eo", "slot_auc"),
    )
    other = replace(cfg, cold_start=replace(cfg.cold_start, epochs=cfg.cold_start.epochs + 1))
    with pytest.raises(PromotionError, match="v2 needs a recorded approval"):
        cold_start_flow.run_all(other, lake, END_DAY, policy=policy, actor="cli")
    mv = MlflowClient().get_model_version("ctr_lora_cold_start", "2")
    assert mv.tags["gate.passed"] == "true" and mv.tags["gate.approval_required"] == "true"
    assert aliases.current("ctr_lora_cold_start") == "1"
    assert [e["to_version"] for e in aliases.history("ctr_lora_cold_start", None)] == ["1"]


def test_the_shipped_policy_gates_the_student_on_measured_fairness_calibration_and_latency(cfg, lake):
    """The cold-start evaluation measures what the adapter evaluation does (issue 13), so the gate's
    fairness, calibration and latency checks on a student carry values: nothing fails for want of a
    measurement, and nothing passes unmeasured but what the shipped policy lists as optional (the
    age-bucket gaps: no age bucket of this tiny data reaches the 200-row minimum)."""
    out = cold_start_flow.run_all(cfg, lake, END_DAY, policy=load_gate_policy(), actor="cli")
    checks = {
        c["name"]: c
        for c in json.loads(MlflowClient().get_model_version("ctr_lora_cold_start", "1").tags["gate.checks"])
    }
    ev = out["evaluation"]
    assert checks["latency_p99_batch32_ms"]["value"] == ev["latency"]["batch_32"]["p99_ms"]
    assert checks["calibration"]["value"] == ev["candidate"]["calibration_ratio"]
    for attr_check in ("fairness_dp[gender]", "fairness_eo[gender]"):
        assert isinstance(checks[attr_check]["value"], float), attr_check
    assert "fairness" not in checks
    unmeasured = {n for n, c in checks.items() if c["value"] is None}
    assert unmeasured == {"fairness_dp[age_bucket]", "fairness_eo[age_bucket]"}
    assert all(checks[n]["passed"] for n in unmeasured)
    assert out["gate"]["passed"] is all(c["passed"] for c in checks.values())


@pytest.mark.parametrize("name", ["dcn", "minilm_text", "tests.pipelines.model.user_family:HashedMLP"])
def test_the_cold_start_flow_runs_on_the_other_families(name, template_db, tmp_path, monkeypatch, lake, text_source):
    """The default family runs the whole flow above; the others (and a user's own network, named by dotted
    path) distill a student on their own default targets (default init), evaluated, registered on their base
    and loadable through the registry."""
    use_store_copy(template_db, tmp_path, monkeypatch)
    monkeypatch.setenv("CTR_CODE_VERSION", "test")
    targets = family.resolve(name).default_targets
    c = tiny_config(lake)
    c = replace(
        c,
        model=family_config(name, CFG, text_source),
        lora=replace(c.lora, target_modules=targets),
        cold_start=replace(c.cold_start, target_modules=targets, init="default"),
    )
    register_base(c, base_model.train(c, lake, BASE_DAY), actor="test", policy=any_base_policy())
    promote_teacher(c, lake, "feed")
    out = cold_start_flow.run_all(c, lake, END_DAY, policy=load_gate_policy(), actor="test")
    assert out["model"] == "ctr_lora_cold_start" and out["version"] == "1"
    assert out["evaluation"]["cold_slice"]["student"]["rows"] > 0
    mv = MlflowClient().get_model_version("ctr_lora_cold_start", "1")
    base_tags = MlflowClient().get_model_version(mv.tags["base.name"], mv.tags["base.version"]).tags
    assert base_tags[integrity.FAMILY_TAG] == mv.tags[integrity.FAMILY_TAG] == name  # the student records it too
    student = pyfunc.load("models:/ctr_lora_cold_start/1")
    rows = pd.concat(list(generate_day(SPEC, "2024-01-10", 64)), ignore_index=True)
    p = student.predict(rows)
    assert len(p) == 64 and ((0 < p) & (p < 1)).all()


@pytest.mark.slow
def test_delta_champions_teach_the_cold_start_student(template_db, tmp_path, monkeypatch, lake):
    """With the shipped recipe's shape (a wide LR base, delta slot adapters), the slot champions that teach the
    cold-start student are delta adapters: they are loaded, scored on the cold rows and distilled from."""
    for cfg in serving_base_config(template_db, tmp_path, monkeypatch, lake, delta=True):
        assert cfg.lora.kind == "delta"
        promote_teacher(cfg, lake, "feed")
        out = cold_start_flow.run_all(cfg, lake, END_DAY, policy=load_gate_policy(), actor="test")
        mv = MlflowClient().get_model_version("ctr_lora_cold_start", out["version"])
        assert json.loads(mv.tags["cold_start.teachers"])["feed"] == "ctr_lora_feed v1"
        champions = out["evaluation"]["cold_slice"]["champions"]
        assert 0.0 < champions["auc"] < 1.0 and champions["rows"] == out["detected"]["rows"]["holdout"]
