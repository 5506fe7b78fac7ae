"""The cold-start flow end to end (the CLI's `cold-start`): detect -> distill -> evaluate -> register ->
gate, twice on the same data, against a real SQLite MLflow store with a serving base and a slot champion."""
from __future__ import annotations

import json

import pytest
from mlflow import MlflowClient

from pipelines.config import PipelineConfig, load_gate_policy
from pipelines.flows import cold_start as cold_start_flow
from tests.pipelines.training.cold_start_helpers import (BASE_DAY, END_DAY, make_champion, promote_teacher,
                                                         serving_base_config, write_lake)


@pytest.fixture(scope="module")
def lake(tmp_path_factory) -> str:
    return write_lake(tmp_path_factory)


@pytest.fixture
def cfg(template_db, tmp_path, monkeypatch, lake) -> PipelineConfig:
    """A serving base trained up to BASE_DAY (ctr_base@champion) in a fresh store."""
    yield from serving_base_config(template_db, tmp_path, monkeypatch, lake)


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
    assert ev["candidate"] == ev["cold_slice"]["student"] and ev["champion"] is None
    assert first["gate"]["first_run"] is True

    c = MlflowClient()
    mv = c.get_model_version("ctr_lora_cold_start", "1")
    for tag in ("data.first", "data.last", "data.sha256", "config.hash", "base.name", "base.version",
                "base.fingerprint", "training.run_id", "cold_start.cutoff", "cold_start.holdout_start"):
        assert mv.tags.get(tag), tag
    assert json.loads(mv.tags["cold_start.teachers"]) == {"feed": "ctr_lora_feed v1", "search": "ctr_base v1",
                                                          "splash": "ctr_base v1"}
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
    assert ev2["cold_slice"] == ev["cold_slice"]                 # deterministic
    assert ev2["champion"]["auc"] == ev2["candidate"]["auc"]     # v1 scored on the same rows: identical
    assert second["detected"] == det
