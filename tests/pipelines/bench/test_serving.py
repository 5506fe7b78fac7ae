"""The serving benchmark runs end to end in quick mode (the HTTP part against a real `mlflow server` and
`python -m pipelines serve`) and reports exactly its figures."""

from __future__ import annotations

import json
import os
import math

import mlflow
import pytest

from pipelines.bench import serving as bench_serving

KEYS = {"switch_ms", "refresh_ms", "load_ms", "routed_vs_merged", "merged_vs_base"}
HTTP_KEYS = {
    *(f"{k}_{b}" for k in ("rps", "p50_ms", "p99_ms") for b in ("b1", "b32")),
    "promote_visible_ms",
    "promote_routes_ms",
    "promote_visible_ms_poll",
    "p99_during_swaps_ratio",
    "base_switch_ms",
}
COUNTS = {"failed_requests", "misrouted_requests", "requests_checked", "moves"}


@pytest.mark.slow
def test_quick_run_reports_every_figure_and_restores_mlflow(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = mlflow.get_tracking_uri()
    env = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
    assert bench_serving.main(["--quick"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out) == KEYS | HTTP_KEYS | COUNTS
    assert all(isinstance(out[k], float) and math.isfinite(out[k]) and out[k] > 0 for k in KEYS | HTTP_KEYS), out
    assert out["failed_requests"] == 0 and out["misrouted_requests"] == 0, out
    assert out["requests_checked"] > 50 and out["moves"] == 20, out
    assert mlflow.get_tracking_uri() == before, "the benchmark's temporary store must not leak"
    assert {k: os.environ.get(k) for k in env} == env, "nor its environment variables"
