"""The adapter stage end to end on a local lake and a SQLite MLflow store: effective lr in the result and
the run's params, the default checkpoint location, resume after a crash past training, cleanup."""

from __future__ import annotations

import json
import tempfile
from dataclasses import replace

import mlflow
import numpy as np
import pandas as pd
import pytest
from mlflow import MlflowClient
from safetensors.numpy import load_file

from pipelines.config import PipelineConfig, config_hash
from pipelines.data.synthetic import SLOTS
from pipelines.model import adapters, features
from pipelines.model.base import CTRModel
from pipelines.model.stream import holdout_streams
from pipelines.registry import mlflow_io
from pipelines.registry.models import sibling_champions
from pipelines.training import adapter, checkpoint
from pipelines.training import orthogonality as ortho
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

    with monkeypatch.context() as m:  # training finishes, logging the model fails: the checkpoint stays
        m.setattr(mlflow_io, "log_ctr_model", crash)
        with pytest.raises(RuntimeError, match="artifact store down"):
            adapter.train(cfg, lake, END_DAY, "feed")
    assert checkpoint.CheckpointStore(where).load()["epoch"] == 2

    resumed = adapter.train(cfg, lake, END_DAY, "feed")
    assert resumed.resumed_from_epoch == 2 and resumed.epochs_run == 2
    assert resumed.effective_lr == pytest.approx(0.02) and resumed.lr_rescaled is True
    assert resumed.stability == pytest.approx(0.025)
    assert resumed.best_epoch in (1, 2)
    assert not (tmp_path / "ckpt" / name / END_DAY).joinpath(config_hash(cfg.lora)[:16], checkpoint.FILENAME).exists()
    params = MlflowClient().get_run(resumed.run_id).data.params
    assert float(params["train.effective_lr"]) == pytest.approx(0.02) and params["lora.lr"] == "0.05"

    fresh = adapter.train(cfg, lake, END_DAY, "feed", checkpoint_uri=str(tmp_path / "elsewhere"))
    assert fresh.resumed_from_epoch is None
    assert fresh.metrics == resumed.metrics  # same seed, same data: the resumed run is the same model


def test_an_adapter_with_trainable_tokens_learns_rows_for_its_windows_ids_only(serving_store, lake):
    """lora.trainable_tokens (issue 14): the stage picks the rows of every id in its train and val rows;
    ids first seen in the holdout keep the base's rows, so the gate judges the adapter on them as on
    tomorrow's new users. The rows are in the logged adapter, which loads like any other."""
    cfg = registered_base_config(lake, epochs=1, lr=0.05, trainable_tokens=("user_id",))
    out = adapter.train(cfg, lake, END_DAY, "feed")
    streams = holdout_streams(cfg, lake, END_DAY, "feed", cfg.model)
    seen = {u for f in streams.index.frames(0, streams.holdout.lo, 65_536, columns=["user_id"]) for u in f["user_id"]}
    later = {u for f in streams.holdout.frames(columns=["user_id"]) for u in f["user_id"]} - seen
    local = mlflow.artifacts.download_artifacts(artifact_uri=out.model_uri) + "/artifacts/adapter"
    indices = json.loads(open(f"{local}/adapter_config.json").read())["trainable_token_indices"]
    assert sorted(indices["embeddings.user_id"]) == features.id_buckets(pd.Series(sorted(seen)), "user_id", cfg.model)
    only_later = set(features.id_buckets(pd.Series(sorted(later)), "user_id", cfg.model)) - set(
        indices["embeddings.user_id"]
    )
    assert later and only_later  # new holdout users exist and their rows were not trained

    model = adapters.load(CTRModel(cfg.model), local)  # the logged adapter's files carry the rows
    assert any("trainable_tokens_delta" in n for n, _ in model.named_parameters())
    assert out.trainable_fraction > lora_only_fraction(cfg)


def lora_only_fraction(cfg) -> float:
    """The trainable fraction of the same adapter without token rows."""
    return adapters.trainable_fraction(adapters.attach(CTRModel(cfg.model), replace(cfg.lora, trainable_tokens=())))[
        "trainable_fraction"
    ]


def test_the_orthogonality_penalty_trains_against_the_other_slots_champions(serving_store, lake):
    """lora.orthogonality_lambda (issue 14): the stage downloads the other slots' champions on its base and
    trains away from them; with none yet it trains as usual. The run records siblings, penalty and |cos|."""
    cfg = registered_base_config(lake, epochs=2, orthogonality_lambda=1.0)
    first = adapter.train(cfg, lake, END_DAY, SLOTS[0])
    assert first.orthogonality is None  # no sibling champion yet: nothing to penalise
    mlflow_io.register(
        first.model_uri,
        first.model_name,
        {"base.fingerprint": first.base["fingerprint"]},
        alias="champion",
        run_id=first.run_id,
    )
    plain = adapter.train(replace(cfg, lora=replace(cfg.lora, orthogonality_lambda=0.0)), lake, END_DAY, SLOTS[1])
    penalised = adapter.train(cfg, lake, END_DAY, SLOTS[1])

    report = penalised.orthogonality
    assert report["siblings"] == [f"{first.model_name}:1"] and report["lambda"] == 1.0
    with tempfile.TemporaryDirectory() as tmp:
        sibling = {k: ortho.saved_factors(d) for k, d in sibling_champions(cfg, plain.model_name, tmp).items()}
        plain_files = mlflow_io.download_artifacts(artifact_uri=plain.model_uri, dst_path=f"{tmp}/p")
        plain_cos = ortho.max_abs_cos(ortho.saved_factors(f"{plain_files}/artifacts/adapter"), sibling)
    assert report["max_abs_cos"] < plain_cos, (report, plain_cos)
    metrics = MlflowClient().get_run(penalised.run_id).data.metrics
    assert metrics["orthogonality_max_abs_cos"] == pytest.approx(report["max_abs_cos"])
    assert MlflowClient().get_run(penalised.run_id).data.tags["orthogonality.siblings"] == report["siblings"][0]


def test_an_adapter_whose_every_epoch_is_worse_than_its_base_is_logged_as_the_base(serving_store, lake):
    """lora.keep_base_if_no_gain: the untrained adapter (the base) competes as epoch 0 of early stopping. A
    learning rate far past the stability rule (allowed by a raised stability_max) makes every epoch's val
    logloss worse than the base's, so epoch 0 is kept: the logged adapter's LoRA B matrices are zero and it
    scores its holdout as the base does. Without the option the same run keeps an epoch of its own."""
    cfg = registered_base_config(
        lake, epochs=2, lr=3.0, stability_max=1000.0, early_stopping_patience=2, keep_base_if_no_gain=True
    )
    kept = adapter.train(cfg, lake, END_DAY, "feed")
    plain = adapter.train(replace(cfg, lora=replace(cfg.lora, keep_base_if_no_gain=False)), lake, END_DAY, "feed")
    assert kept.effective_lr == 3.0 and kept.lr_rescaled is False
    assert kept.best_epoch == 0 and plain.best_epoch in (1, 2)
    with tempfile.TemporaryDirectory() as tmp:
        files = mlflow_io.download_artifacts(artifact_uri=kept.model_uri, dst_path=tmp)
        weights = load_file(f"{files}/artifacts/adapter/adapter_model.safetensors")
    b = [w for k, w in weights.items() if "lora_B" in k]
    assert b and all(not np.any(w) for w in b)
    assert kept.metrics["logloss"] < plain.metrics["logloss"]
