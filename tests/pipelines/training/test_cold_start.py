"""Cold start: the teacher choice, and the stage end to end (detect -> distill -> evaluate -> register -> gate)
on a local lake with a real SQLite MLflow store. Detection and the split: test_cold_entities.py."""
from __future__ import annotations

import json

import mlflow
import numpy as np
import pytest
from mlflow import MlflowClient

from pipelines.config import (BaseTrainConfig, ColdStartConfig, DataConfig, LoraTrainConfig, PipelineConfig,
                              load_gate_policy)
from pipelines.data.lake import Lake
from pipelines.data.synthetic import SLOTS, write_days
from pipelines.errors import PipelineError
from pipelines.flows import cold_start as cold_start_flow
from pipelines.training import cold_start as CS
from tests.conftest import use_store_copy
from tests.pipelines.training.helpers import CFG, SPEC


def test_choose_teacher_falls_back_to_the_base_only_when_it_predicts_the_labelled_rows_better():
    import torch

    from pipelines.model.base import CTRModel

    def Const(logit: float) -> CTRModel:
        """A real CTRModel whose logit is `logit` for every row (zero head weights, constant bias)."""
        torch.manual_seed(0)
        m = CTRModel(CFG)
        torch.nn.init.zeros_(m.head.weight)
        torch.nn.init.constant_(m.head.bias, logit)
        return m

    x = np.zeros((40, 9), dtype=np.int64)
    y = np.r_[np.ones(30), np.zeros(10)].astype(np.float32)   # 75% positive
    good, bad = Const(float(np.log(3.0))), Const(-1.0)          # p = 0.75 vs p = 0.27
    slots = np.array(["feed"] * 20 + ["search"] * 20)
    chosen = CS.choose_teacher({"feed": bad, "search": bad, None: good}, x, y, slots)
    assert chosen["kind"] == "base" and chosen["labelled_logloss"]["base"] < chosen["labelled_logloss"]["champions"]
    no_fallback = CS.choose_teacher({"feed": bad, "search": bad, None: good}, x, y, slots, fallback=False)
    assert no_fallback["kind"] == "champions"
    assert CS.choose_teacher({"feed": good, "search": good, None: bad}, x, y, slots)["kind"] == "champions"
    # no champion anywhere: the "champions" are the base itself, a tie, and the champions' path is kept
    assert CS.choose_teacher({None: good}, x, y, slots)["kind"] == "champions"


# ----------------------------------------------------------------------------- the stage
BASE_DAY, END_DAY = "2024-01-04", "2024-01-09"


@pytest.fixture(scope="module")
def lake(tmp_path_factory) -> str:
    uri = str(tmp_path_factory.mktemp("lake"))
    write_days(Lake(uri), SPEC, "2024-01-02", 8, 2000)
    return uri


def tiny_config(lake: str, **cold) -> PipelineConfig:
    return PipelineConfig(
        data=DataConfig(lake_uri=lake, slots=SLOTS), model=CFG,
        base_training=BaseTrainConfig(train_start="2024-01-02", epochs=1, batch_size=256),
        lora=LoraTrainConfig(r=4, alpha=8, epochs=2, batch_size=64, window_days=3, min_rows=100, warmup_steps=2),
        cold_start=ColdStartConfig(**{**dict(window_days=5, history_days=3, min_impressions=3, r=4, alpha=8, epochs=3,
                                             batch_size=64, transfer_batch_size=128, min_labelled_rows=50,
                                             min_holdout_rows=50), **cold}))


@pytest.fixture
def cfg(template_db, tmp_path, monkeypatch, lake) -> PipelineConfig:
    """A serving base trained up to BASE_DAY (ctr_base@champion) in a fresh store."""
    from pipelines.flows.base import register_base
    from pipelines.training import base_model

    use_store_copy(template_db, tmp_path, monkeypatch)
    monkeypatch.setenv("CTR_CODE_VERSION", "test")
    c = tiny_config(lake)
    register_base(c, base_model.train(c, lake, BASE_DAY), actor="test")
    yield c
    mlflow.set_tracking_uri(None)


def make_champion(model: str, version: str) -> None:
    """Point model@champion at version (this tiny data's AUC is near 0.5: the gate is not the point here)."""
    from pipelines.promotion import aliases

    aliases.move_alias(model, "champion", version, kind="promote", reason="test setup", actor="test")


def promote_teacher(cfg: PipelineConfig, lake: str, slot: str) -> None:
    """ctr_lora_<slot>@champion through the real adapter path (train, evaluate, register)."""
    from pipelines.evaluation.compare import evaluate
    from pipelines.registry.register import register
    from pipelines.training import adapter

    cand = adapter.train(cfg, lake, "2024-01-07", slot)
    reg = register(cfg, cand, evaluate(cfg, lake, cand))
    make_champion(reg["model"], reg["version"])


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


def test_stage_refusals(cfg, lake, monkeypatch):
    with pytest.raises(PipelineError, match="slot 'nope' is not configured"):
        CS.detect_stage(cfg, lake, END_DAY, "nope")
    few = tiny_config(lake, min_labelled_rows=10 ** 6)
    with pytest.raises(PipelineError, match="cold_start.min_labelled_rows"):
        CS.detect_stage(few, lake, END_DAY)

    detected = CS.detect_stage(cfg, lake, END_DAY, "feed")
    assert detected["model_name"] == "ctr_lora_cold_start_feed" and detected["slot"] == "feed"
    runs_before = len(mlflow.search_runs(search_all_experiments=True))
    changed = {**detected, "data": {**detected["data"], "sha256": "0" * 64}}
    with pytest.raises(PipelineError, match="changed between detection and distillation"):
        CS.distill_stage(cfg, lake, END_DAY, "feed", detected=changed)
    assert len(mlflow.search_runs(search_all_experiments=True)) == runs_before  # refused before training

    no_base = tiny_config(lake)
    from pipelines.config import RegistryConfig

    no_base = PipelineConfig(**{**no_base.__dict__, "registry": RegistryConfig(base_model_name="ctr_base_missing")})
    with pytest.raises(PipelineError, match="no serving base"):
        CS.detect_stage(no_base, lake, END_DAY)
