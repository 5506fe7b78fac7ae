"""A small cold-start setting shared by the cold-start stage tests and the cold-start flow test: eight
synthetic days, a serving base trained up to BASE_DAY, and a slot champion trained the real way."""

from __future__ import annotations

import dataclasses

import mlflow
import pytest

from pipelines.config import BaseTrainConfig, ColdStartConfig, DataConfig, LoraTrainConfig, PipelineConfig
from pipelines.data.lake import Lake
from pipelines.data.synthetic import SLOTS, write_days
from pipelines.evaluation.compare import evaluate
from pipelines.flows.base import register_base
from pipelines.promotion import aliases
from pipelines.registry.register import register
from pipelines.training import adapter, base_model
from tests.conftest import any_base_policy, use_store_copy, validate_lake
from tests.pipelines.training.helpers import CFG, SPEC

BASE_DAY, END_DAY = "2024-01-04", "2024-01-09"


def write_lake(tmp_path_factory) -> str:
    """Eight synthetic days from 2024-01-02, 2,000 rows each (module-scoped in the tests)."""
    uri = str(tmp_path_factory.mktemp("lake"))
    write_days(Lake(uri), SPEC, "2024-01-02", 8, 2000)
    validate_lake(uri)  # cold start reads validated days only, as after the DAG's validate task
    return uri


def tiny_config(lake: str, *, delta: bool = False, **cold) -> PipelineConfig:
    """`delta`: the shipped recipe's shape, small: a wide LR base and delta slot adapters (the teachers)."""
    lora = dict(kind="delta", lr=0.3, trainable_tokens=("user_id", "item_id"), train_rows="all") if delta else {}
    return PipelineConfig(
        data=DataConfig(lake_uri=lake, slots=SLOTS),
        model=dataclasses.replace(CFG, wide=delta),
        base_training=BaseTrainConfig(
            train_start="2024-01-02", epochs=1, batch_size=256, wide_l2=3.0 if delta else 0.0
        ),
        lora=LoraTrainConfig(
            **{**dict(r=4, alpha=8, epochs=2, batch_size=64, window_days=3, min_rows=100, warmup_steps=2), **lora}
        ),
        cold_start=ColdStartConfig(
            **{
                **dict(
                    window_days=5,
                    history_days=3,
                    min_impressions=3,
                    r=4,
                    alpha=8,
                    epochs=3,
                    batch_size=64,
                    transfer_batch_size=128,
                    min_labelled_rows=50,
                    min_holdout_rows=50,
                ),
                **cold,
            }
        ),
    )


def serving_base_config(template_db, tmp_path, monkeypatch, lake, delta: bool = False):
    """A serving base trained up to BASE_DAY (ctr_base@champion) in a fresh store (`tiny_config`'s `delta`)."""
    use_store_copy(template_db, tmp_path, monkeypatch)
    monkeypatch.setenv("CTR_CODE_VERSION", "test")
    c = tiny_config(lake, delta=delta)
    register_base(c, base_model.train(c, lake, BASE_DAY), actor="test", policy=any_base_policy())
    try:
        yield c
    finally:
        mlflow.set_tracking_uri(None)


def make_champion(model: str, version: str) -> None:
    """Point model@champion at version (this tiny data's AUC is near 0.5: the gate is not the point here)."""
    aliases.move_alias(model, "champion", version, kind="promote", reason="test setup", actor="test")


def promote_teacher(cfg: PipelineConfig, lake: str, slot: str) -> None:
    """ctr_lora_<slot>@champion through the real adapter path (train, evaluate, register)."""
    cand = adapter.train(cfg, lake, "2024-01-07", slot).to_dict()
    reg = register(cfg, cand, evaluate(cfg, lake, cand))
    make_champion(reg["model"], reg["version"])


# The fixtures of the three cold-start test modules (stage, evaluation, flow): each imports them,
# and they replace tests/pipelines/conftest.py's `lake` and `cfg` there.
@pytest.fixture(scope="module", name="lake")
def cold_lake(tmp_path_factory) -> str:
    return write_lake(tmp_path_factory)


@pytest.fixture(name="cfg")
def cold_cfg(template_db, tmp_path, monkeypatch, lake) -> PipelineConfig:
    """A serving base trained up to BASE_DAY (ctr_base@champion) in a fresh store."""
    yield from serving_base_config(template_db, tmp_path, monkeypatch, lake)
