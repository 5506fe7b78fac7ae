"""Cold start's training side: the teacher choice, and the stages' refusals, on a local lake with a real
SQLite MLflow store. Detection and the split: tests/pipelines/data/test_cold.py; the whole run
(detect -> distill -> evaluate -> register -> gate): tests/pipelines/flows/test_cold_start.py."""

from __future__ import annotations

import mlflow
import numpy as np
import pytest
import torch

from pipelines.config import PipelineConfig, RegistryConfig
from pipelines.errors import PipelineError
from pipelines.model.base import CTRModel
from pipelines.training import cold_start as CS
from tests.pipelines.training.cold_start_helpers import END_DAY, tiny_config
from tests.pipelines.training.cold_start_helpers import cold_cfg, cold_lake  # noqa: F401  (fixtures `cfg`, `lake`)
from tests.pipelines.training.helpers import CFG


def test_choose_teacher_falls_back_to_the_base_only_when_it_predicts_the_labelled_rows_better():
    def Const(logit: float) -> CTRModel:
        """A real CTRModel whose logit is `logit` for every row (zero head weights, constant bias)."""
        torch.manual_seed(0)
        m = CTRModel(CFG)
        torch.nn.init.zeros_(m.head.weight)
        torch.nn.init.constant_(m.head.bias, logit)
        return m

    x = np.zeros((40, 9), dtype=np.int64)
    y = np.r_[np.ones(30), np.zeros(10)].astype(np.float32)  # 75% positive
    good, bad = Const(float(np.log(3.0))), Const(-1.0)  # p = 0.75 vs p = 0.27
    slots = np.array(["feed"] * 20 + ["search"] * 20)
    chosen = CS.choose_teacher({"feed": bad, "search": bad, None: good}, x, y, slots)
    assert chosen["kind"] == "base" and chosen["labelled_logloss"]["base"] < chosen["labelled_logloss"]["champions"]
    no_fallback = CS.choose_teacher({"feed": bad, "search": bad, None: good}, x, y, slots, fallback=False)
    assert no_fallback["kind"] == "champions"
    assert CS.choose_teacher({"feed": good, "search": good, None: bad}, x, y, slots)["kind"] == "champions"
    # no champion anywhere: the "champions" are the base itself, a tie, and the champions' path is kept
    assert CS.choose_teacher({None: good}, x, y, slots)["kind"] == "champions"


# ----------------------------------------------------------------------------- the stage
def test_stage_refusals(cfg, lake, monkeypatch):
    with pytest.raises(PipelineError, match="slot 'nope' is not configured"):
        CS.detect_stage(cfg, lake, END_DAY, "nope")
    few = tiny_config(lake, min_labelled_rows=10**6)
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

    no_base = PipelineConfig(**{**no_base.__dict__, "registry": RegistryConfig(base_model_name="ctr_base_missing")})
    with pytest.raises(PipelineError, match="no serving base"):
        CS.detect_stage(no_base, lake, END_DAY)
