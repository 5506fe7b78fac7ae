"""Small, deterministic models and data shared by the training tests (and the resume helper script)."""
from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from pipelines.config import ModelConfig
from pipelines.data.synthetic import SyntheticSpec, generate_day
from pipelines.model import features
from pipelines.model.base import CTRModel

CFG = ModelConfig(embed_dim=16, n_heads=2, n_blocks=1, id_buckets=1024)
SPEC = SyntheticSpec(n_users=2_000, n_items=300, n_advertisers=30, new_users_per_day=100, new_items_per_day=10,
                     seed=7)


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
