"""Small, deterministic models and data shared by the training tests (and the resume helper script)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from pipelines.config import BaseTrainConfig, DataConfig, LoraTrainConfig, ModelConfig, PipelineConfig, RegistryConfig
from pipelines.data.synthetic import SLOTS, SyntheticSpec, generate_day
from pipelines.flows.base import register_base
from pipelines.model import features
from pipelines.model.base import CTRModel
from pipelines.registry import mlflow_io
from pipelines.training import base_model
from tests.conftest import any_base_policy

CFG = ModelConfig(embed_dim=16, n_heads=2, n_blocks=1, id_buckets=1024)
SPEC = SyntheticSpec(n_users=2_000, n_items=300, n_advertisers=30, new_users_per_day=100, new_items_per_day=10, seed=7)


def rows(day: str, n: int) -> tuple[np.ndarray, np.ndarray]:
    frame = pd.concat(list(generate_day(SPEC, day, n)), ignore_index=True)
    return features.encode(frame, CFG), features.labels(frame)


def base(seed: int = 0) -> CTRModel:
    """A fresh base, identical in every process for the same seed (LayerNorm biases start at 0)."""
    torch.manual_seed(seed)
    return CTRModel(CFG)


def out(model, x: np.ndarray) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(torch.from_numpy(x))


def registered_base_config(lake: str, registry=None, model=None, cold_start=None, base_training=None, **lora_overrides):
    """A PipelineConfig on the synthetic `lake` (2024-01-02 onwards) whose base is trained on its first
    two days and registered as <base>@champion in the current MLflow store (the caller points MLflow at
    a fresh one, see tests.conftest.use_store_copy, or gives model names of its own in `registry`, a
    RegistryConfig, on a shared server). `model` / `cold_start` / `base_training`: other sections than the small
    defaults."""
    lora = {
        "r": 4,
        "alpha": 8,
        "epochs": 1,
        "batch_size": 64,
        "lr": 0.02,
        "window_days": 2,
        "min_rows": 100,
        "warmup_steps": 2,
        **lora_overrides,
    }
    extra = {"cold_start": cold_start} if cold_start is not None else {}
    c = PipelineConfig(
        data=DataConfig(lake_uri=lake, slots=SLOTS),
        model=model or CFG,
        base_training=base_training or BaseTrainConfig(train_start="2024-01-02", epochs=1, batch_size=256),
        lora=LoraTrainConfig(**lora),
        registry=registry or RegistryConfig(),
        **extra,
    )
    out = register_base(c, base_model.train(c, lake, "2024-01-03"), actor="test", policy=any_base_policy())
    # serving it: moved now, or already (the same weights trained before on a shared server are one version)
    assert mlflow_io.version_by_alias(c.registry.base_model_name, "champion").version in (
        out["version"],
        int(out["version"]),
    )
    return c
