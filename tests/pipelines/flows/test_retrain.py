"""The slot retrain flow (the CLI's `train-adapter --register`): train -> evaluate -> register -> gate
and release, against a real SQLite MLflow store with a serving base, on a small synthetic lake."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipelines.config import load_gate_policy
from pipelines.errors import PromotionError
from pipelines.flows import retrain
from pipelines.promotion import aliases, release
from pipelines.registry import mlflow_io

END_DAY = "2024-01-05"


@pytest.mark.slow
def test_a_first_adapter_is_trained_registered_gated_and_serves(cfg, lake):
    policy = load_gate_policy()
    decision = retrain.run(cfg, policy, lake, END_DAY, "feed", actor="test")
    name = cfg.adapter_model_name("feed")
    assert decision["first_run"] is True  # no champion yet: absolute thresholds only
    mv = mlflow_io.get_version(name, decision["version"])
    assert mv.tags["gate.passed"] == str(decision["passed"]).lower()
    assert mv.tags["data.last"] == END_DAY and mv.tags["base.name"] == cfg.registry.base_model_name
    if decision["passed"]:
        assert aliases.current(name) == decision["version"]
        assert aliases.history(name)[-1]["actor"] == "test"
    else:
        assert aliases.current(name) is None  # a rejected first version never serves

    again = retrain.run(cfg, policy, lake, END_DAY, "feed", actor="test")  # same data, config and code
    assert again["version"] == decision["version"]  # registration is idempotent: no second version
    assert len(mlflow_io.client().search_model_versions(f"name = '{name}'")) == 1


@pytest.mark.slow
def test_the_cli_flow_cannot_release_past_a_required_approval(cfg, lake):
    """`train-adapter --register` runs this flow in one process, where nobody can answer an approval:
    with `approval: true` the version is registered and gated, and the release is refused (issue 13).
    A recorded approval then releases it through the library, as `python -m pipelines approve` does."""
    # Lenient thresholds and the tiny lake's unmeasurable checks optional: a pass is what is needed here.
    policy = replace(
        load_gate_policy(),
        approval=True,
        promotion="direct",
        min_auc_first_run=0.5,
        max_logloss_first_run=5.0,
        max_demographic_parity_gap=1.0,
        max_equalized_odds_gap=1.0,
        calibration_min=0.01,
        calibration_max=100.0,
        latency_budget_ms=60_000.0,
        optional_checks=("fairness", "fairness_dp", "fairness_eo", "calibration", "slot_auc"),
    )
    with pytest.raises(PromotionError, match="needs a recorded approval"):
        retrain.run(cfg, policy, lake, END_DAY, "feed", actor="cli")
    name = cfg.adapter_model_name("feed")
    (mv,) = mlflow_io.client().search_model_versions(f"name = '{name}'")
    assert mv.tags["gate.passed"] == "true" and mv.tags["gate.approval_required"] == "true"
    assert aliases.current(name) is None and aliases.history(name, None) == []

    release.record_approval(name, str(mv.version), answer="Approve", by="alice", at="now", task="cli")
    assert release.release(policy, name, str(mv.version), actor="alice")["moved"]
    assert aliases.current(name) == str(mv.version)
