"""A user's own network, as a team would bring it (issue 15, "Done when"): nothing of the project's model
code underneath, only the family protocol (`pipelines/model/family.py`). A hashed embedding per field,
concatenated, and a two-layer MLP with a logit on top; LoRA targets its `fc1` / `fc2`. The config names it
`model.family: tests.pipelines.model.user_family:HashedMLP`.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch
from torch import nn

FIELDS = ("user_id", "item_id", "slot", "age_bucket", "gender", "occupation", "category", "hour", "weekday")


class HashedMLPModule(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.table = nn.Embedding(len(FIELDS) * cfg.id_buckets, cfg.embed_dim)
        hidden = cfg.embed_dim * cfg.ffn_mult
        self.fc1 = nn.Linear(len(FIELDS) * cfg.embed_dim, hidden)
        self.fc2 = nn.Linear(hidden, cfg.embed_dim)
        self.out = nn.Linear(cfg.embed_dim, 1)

    def logits_and_pooled(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = torch.relu(self.fc2(torch.relu(self.fc1(self.table(tokens).flatten(1)))))
        return self.out(z).squeeze(-1), z

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.logits_and_pooled(tokens)[0]


class HashedMLP:
    name = "tests.pipelines.model.user_family:HashedMLP"
    default_targets = ("fc1", "fc2")

    def build(self, cfg) -> nn.Module:
        return HashedMLPModule(cfg)

    def encode(self, frame: pd.DataFrame, cfg) -> np.ndarray:
        """Field k's value hashed into rows [k * id_buckets, (k + 1) * id_buckets) of the one table."""
        cols = [
            pd.util.hash_array(frame[f].astype(str).to_numpy()) % np.uint64(cfg.id_buckets)
            + np.uint64(k * cfg.id_buckets)
            for k, f in enumerate(FIELDS)
        ]
        return np.stack(cols, axis=1).astype(np.int64) if len(frame) else np.zeros((0, len(FIELDS)), np.int64)

    def load_pretrained(self, module: nn.Module, cfg) -> None:
        return None
