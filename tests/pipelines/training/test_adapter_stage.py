"""The adapter stage end to end on a local lake and a SQLite MLflow store: effective lr in the result and
the run's params, the default checkpoint location, resume after a crash past training, cleanup."""
from __future__ import annotations

import pytest
from mlflow import MlflowClient

from pipelines.config import PipelineConfig, config_hash
from pipelines.registry import mlflow_io
from pipelines.training import adapter, checkpoint
from tests.pipelines.training.helpers import registered_base_config

END_DAY = "2024-01-05"


@pytest.fixture
def cfg(serving_store, lake) -> PipelineConfig:
    # stability 0.05 * 4 / sqrt(64) = 0.025 > 0.01: trains at the rescaled lr 0.02
    return registered_base_config(lake, epochs=2, lr=0.05)


def test_adapter_records_the_effective_lr_and_resumes_after_a_crash(cfg, lake, tmp_path, monkeypatch):
    name = cfg.adapter_model_name("feed")
    where = checkpoint.default_uri(str(tmp_path / "ckpt"), name, END_DAY, config_hash(cfg.lora))

    def crash(*a, **k):
        raise RuntimeError("artifact store down")

    with monkeypatch.context() as m:   # training finishes, logging the model fails: the checkpoint stays
        m.setattr(mlflow_io, "log_ctr_model", crash)
        with pytest.raises(RuntimeError, match="artifact store down"):
            adapter.train(cfg, lake, END_DAY, "feed")
    assert checkpoint.CheckpointStore(where).load()["epoch"] == 2

    resumed = adapter.train(cfg, lake, END_DAY, "feed")
    assert resumed["resumed_from_epoch"] == 2 and resumed["epochs_run"] == 2
    assert resumed["effective_lr"] == pytest.approx(0.02) and resumed["lr_rescaled"] is True
    assert resumed["stability"] == pytest.approx(0.025)
    assert resumed["best_epoch"] in (1, 2)
    assert not (tmp_path / "ckpt" / name / END_DAY).joinpath(config_hash(cfg.lora)[:16], checkpoint.FILENAME).exists()
    params = MlflowClient().get_run(resumed["run_id"]).data.params
    assert float(params["train.effective_lr"]) == pytest.approx(0.02) and params["lora.lr"] == "0.05"

    fresh = adapter.train(cfg, lake, END_DAY, "feed", checkpoint_uri=str(tmp_path / "elsewhere"))
    assert fresh["resumed_from_epoch"] is None
    assert fresh["metrics"] == resumed["metrics"]   # same seed, same data: the resumed run is the same model
