"""The serving benchmark runs end to end in quick mode and reports exactly its five figures."""
from __future__ import annotations

import json
import os
import math

import mlflow
import pytest

from pipelines.bench import serving as bench_serving

KEYS = {"switch_ms", "refresh_ms", "load_ms", "routed_vs_merged", "merged_vs_base"}


@pytest.mark.slow
def test_quick_run_reports_the_five_positive_figures_and_restores_mlflow(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = mlflow.get_tracking_uri()
    env = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
    assert bench_serving.main(["--quick"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out) == KEYS
    assert all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in out.values()), out
    assert mlflow.get_tracking_uri() == before, "the benchmark's temporary store must not leak"
    assert {k: os.environ.get(k) for k in env} == env, "nor its environment variables"
