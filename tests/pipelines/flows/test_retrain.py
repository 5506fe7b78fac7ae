"""The slot retrain flow (the CLI's `train-adapter --register`): train -> evaluate -> register -> gate
and release, against a real SQLite MLflow store with a serving base, on a small synthetic lake."""
from __future__ import annotations

import pytest

from pipelines.config import load_gate_policy
from pipelines.flows import retrain
from pipelines.promotion import aliases
from pipelines.registry import mlflow_io

END_DAY = "2024-01-05"


@pytest.mark.slow
def test_a_first_adapter_is_trained_registered_gated_and_serves(cfg, lake):
    policy = load_gate_policy()
    decision = retrain.run(cfg, policy, lake, END_DAY, "feed", actor="test")
    name = cfg.adapter_model_name("feed")
    assert decision["first_run"] is True           # no champion yet: absolute thresholds only
    mv = mlflow_io.get_version(name, decision["version"])
    assert mv.tags["gate.passed"] == str(decision["passed"]).lower()
    assert mv.tags["data.last"] == END_DAY and mv.tags["base.name"] == cfg.registry.base_model_name
    if decision["passed"]:
        assert aliases.current(name) == decision["version"]
        assert aliases.history(name)[-1]["actor"] == "test"
    else:
        assert aliases.current(name) is None       # a rejected first version never serves

    again = retrain.run(cfg, policy, lake, END_DAY, "feed", actor="test")   # same data, config and code
    assert again["version"] == decision["version"]   # registration is idempotent: no second version
    assert len(mlflow_io.client().search_model_versions(f"name = '{name}'")) == 1
