"""The base-model flow (the CLI's `train-base --register`, the ctr_base_model DAG's tasks): a new base
is registered as `ctr_base@candidate`, gated against the serving base on the same holdout rows, and
becomes `@champion` only through a recorded move that lists the adapters it makes incompatible."""

from __future__ import annotations

import dataclasses

import mlflow
import pandas as pd
import pytest
from mlflow import MlflowClient

from pipelines.config import BaseTrainConfig, DataConfig, PipelineConfig, load_gate_policy
from pipelines.data.splits import load_split
from pipelines.data.synthetic import SLOTS
from pipelines.errors import PromotionError
from pipelines.flows import base
from pipelines.model import family, features
from pipelines.model.base import fingerprint
from pipelines.promotion import aliases
from pipelines.registry import lock, mlflow_io
from pipelines.training import base_model
from pipelines.training.base_fit import fit_base
from pipelines.training.loop import seed_everything
from tests.conftest import any_base_policy
from tests.pipelines.training.helpers import CFG

NAME = "ctr_base"


def _config(lake: str) -> PipelineConfig:
    return PipelineConfig(
        data=DataConfig(lake_uri=lake, slots=SLOTS),
        model=CFG,
        base_training=BaseTrainConfig(train_start="2024-01-02", epochs=1, batch_size=256),
    )


def _adapter_champion(model: str, fingerprint: str, base_version: str) -> str:
    """A serving adapter trained on the base with `fingerprint` (a synthetic version: never loaded here)."""
    c = MlflowClient()
    c.create_registered_model(model)
    v = c.create_model_version(
        model,
        source="s3://ctr-test/never-read",
        tags={"gate.passed": "true", "base.name": NAME, "base.version": base_version, "base.fingerprint": fingerprint},
    ).version
    aliases.promote(model, str(v), reason="trained on the first base", actor="test")
    return str(v)


@pytest.mark.slow
def test_a_base_no_better_than_chance_is_registered_as_a_candidate_and_rejected(serving_store, lake):
    """The shipped policy's first-run floor: the tiny base (AUC ~0.5 on 400 rows) never serves; rejected,
    it loses @candidate and says why on the version (tag `rejected`)."""
    out = base.run(_config(lake), lake, "2024-01-03", actor="test", policy=load_gate_policy())
    assert out["passed"] is False and out["moved"] is False
    assert aliases.current(NAME) is None and aliases.current(NAME, "candidate") is None
    tags = mlflow_io.get_version(NAME, out["version"]).tags
    assert tags["rejected"].startswith("gate: ") and "auc_floor" in tags["rejected"]
    assert tags["gate.passed"] == "false" and tags["fingerprint"] == out["fingerprint"]
    assert '"name": "auc_floor"' in tags["gate.checks"] and aliases.history(NAME) == []
    with pytest.raises(PromotionError, match="never passed its gate"):  # nor by hand
        aliases.promote(NAME, out["version"], reason="try anyway", actor="mallory")


@pytest.mark.slow
def test_a_new_base_is_gated_against_the_serving_one_and_its_move_lists_the_adapters_it_strands(serving_store, lake):
    cfg = _config(lake)
    first = base.register_base(cfg, base_model.train(cfg, lake, "2024-01-03"), actor="test", policy=any_base_policy())
    assert first["moved"] and aliases.current(NAME) == first["version"] == "1"
    assert aliases.history(NAME)[-1]["reason"] == (
        "base passed gate (first base); adapters this base makes incompatible (retrain them): none"
    )
    adapter = _adapter_champion("ctr_lora_morning", first["fingerprint"], first["version"])
    c = MlflowClient()  # another base model serving: not an adapter, not stranded
    c.create_registered_model("ctr_base_other")
    c.create_model_version("ctr_base_other", source="s3://ctr-test/never-read", tags={"fingerprint": "e" * 64})
    c.set_registered_model_alias("ctr_base_other", "champion", "1")

    trained = base_model.train(cfg, lake, "2024-01-04")  # one more day: other weights
    ev = trained["evaluation"]
    assert trained["fingerprint"] != first["fingerprint"] and ev["champion_version"] == "1"
    assert ev["champion"]["rows"] == ev["candidate"]["rows"] == ev["holdout_rows"] > 0  # the same rows
    second = base.register_base(cfg, trained, actor="alice", policy=any_base_policy(), op_id="op-base-2")
    assert second["moved"] and aliases.current(NAME) == second["version"] == "2"
    stranded = [
        {
            "model": "ctr_lora_morning",
            "alias": "champion",
            "version": adapter,
            "base_version": "1",
            "base_fingerprint": first["fingerprint"],
        }
    ]
    assert second["incompatible"] == stranded
    last = aliases.history(NAME)[-1]
    assert (last["kind"], last["from_version"], last["to_version"], last["actor"]) == ("promote", "1", "2", "alice")
    assert last["reason"] == (
        "base passed gate against v1; adapters this base makes incompatible (retrain them): "
        f"ctr_lora_morning@champion v{adapter}"
    )
    tags = mlflow_io.get_version(NAME, "2").tags
    assert tags["gate.passed"] == "true" and tags["gate.champion_version"] == "1"
    # the stranded adapter is refused from now on, by any move
    with pytest.raises(PromotionError, match="incompatible"):
        aliases.promote("ctr_lora_morning", adapter, reason="promote it again", actor="test")


@pytest.mark.slow
def test_a_rejected_base_leaves_the_serving_base_alone_and_a_rerun_registers_nothing_new(serving_store, lake):
    cfg = _config(lake)
    base.register_base(cfg, base_model.train(cfg, lake, "2024-01-03"), actor="test", policy=any_base_policy())
    strict = dataclasses.replace(any_base_policy(), calibration_min=0.999, calibration_max=1.001)
    trained = base_model.train(cfg, lake, "2024-01-04")
    out = base.register_base(cfg, trained, actor="test", policy=strict)
    assert out["passed"] is False and aliases.current(NAME) == "1" and len(aliases.history(NAME)) == 1
    again = base.register_candidate(cfg, trained)  # a retried register task: the same version
    assert (again["version"], again["existing"]) == (out["version"], True)
    assert len(MlflowClient().search_model_versions(f"name = '{NAME}'")) == 2


def test_without_a_shared_registry_lock_nothing_is_trained(lake, monkeypatch):
    # An HTTP tracking server and no CTR_REGISTRY_LOCK_URL: the champion move would be refused, so
    # the flow refuses before it trains (no run, no version that nothing serves).
    monkeypatch.delenv(lock.LOCK_URL_ENV, raising=False)
    mlflow.set_tracking_uri("http://127.0.0.1:9")  # nothing listens: any request would fail differently
    try:
        with pytest.raises(PromotionError, match=lock.LOCK_URL_ENV):
            base.run(_config(lake), lake, "2024-01-03")
    finally:
        mlflow.set_tracking_uri(None)


@pytest.mark.slow
def test_with_refit_all_rows_the_holdout_scores_the_recipe_and_the_base_that_ships_learns_every_row(
    serving_store, lake
):
    """The gate's evidence is the run without the holdout; the weights registered are the same recipe,
    from the same seed, fitted on the window's training rows and its holdout together."""
    held = _config(lake)
    refit = dataclasses.replace(held, base_training=dataclasses.replace(held.base_training, refit_all_rows=True))
    without, with_refit = base_model.train(held, lake, "2024-01-03"), base_model.train(refit, lake, "2024-01-03")
    assert with_refit["evaluation"]["candidate"] == without["evaluation"]["candidate"]  # the same evidence
    assert with_refit["fingerprint"] != without["fingerprint"]

    bt = refit.base_training
    split = load_split(lake, "2024-01-03", bt.holdout_fraction, start_day=bt.train_start)
    every_row = pd.concat([split.train, split.holdout], ignore_index=True)
    seed_everything(bt.seed)
    fam = family.resolve(refit.model.family)
    model = fam.build(refit.model)
    fam.load_pretrained(model, refit.model)
    fit_base(model, family.encode(every_row, refit.model), features.labels(every_row), bt)
    assert fingerprint(model) == with_refit["fingerprint"]
    logged = MlflowClient().get_run(with_refit["run_id"]).data.metrics
    assert logged["refit_rows"] == len(every_row) == len(split.train) + without["evaluation"]["holdout_rows"]
