"""The base-model flow (the CLI's `train-base --register`): train, register with lineage, crown it."""
from __future__ import annotations

import mlflow
import pytest

from pipelines.config import BaseTrainConfig, DataConfig, PipelineConfig
from pipelines.data.synthetic import SLOTS
from pipelines.errors import PromotionError
from pipelines.flows import base
from pipelines.promotion import aliases, lock
from pipelines.registry import mlflow_io
from tests.pipelines.training.helpers import CFG


def _config(lake: str) -> PipelineConfig:
    return PipelineConfig(data=DataConfig(lake_uri=lake, slots=SLOTS), model=CFG,
                          base_training=BaseTrainConfig(train_start="2024-01-02", epochs=1, batch_size=256))


@pytest.mark.slow
def test_a_trained_base_is_registered_with_its_lineage_and_becomes_the_champion(serving_store, lake):
    cfg = _config(lake)
    out = base.run(cfg, lake, "2024-01-03", actor="test")
    name = cfg.registry.base_model_name
    assert aliases.current(name) == out["version"] and out["moved"] is True
    tags = mlflow_io.get_version(name, out["version"]).tags
    assert tags["fingerprint"] == out["fingerprint"]
    assert tags["data.last"] == "2024-01-03" and tags["gate.kind"] == "direct"
    assert aliases.history(name)[-1]["reason"] == "base model trained up to 2024-01-03"


def test_without_a_shared_registry_lock_nothing_is_trained(lake, monkeypatch):
    # An HTTP tracking server and no CTR_REGISTRY_LOCK_URL: the champion move would be refused, so
    # the flow refuses before it trains (no run, no version that nothing serves).
    monkeypatch.delenv(lock.LOCK_URL_ENV, raising=False)
    mlflow.set_tracking_uri("http://127.0.0.1:9")   # nothing listens: any request would fail differently
    try:
        with pytest.raises(PromotionError, match=lock.LOCK_URL_ENV):
            base.run(_config(lake), lake, "2024-01-03")
    finally:
        mlflow.set_tracking_uri(None)
