"""DCN-v2 (Wang et al., 2021), the `dcn` model family: a cross network and a deep tower side by side over
the same hashed field embeddings as the default family, then a logit.

x0 is the concatenation of the field embeddings [batch, F*D]. Cross layer l: x_{l+1} = x0 * W_l(x_l) + x_l
(`cross.<l>.cross_proj`, a full-rank W_l, the "v2" cross). Deep tower: `deep.<l>.deep_proj` Linear + ReLU.
Their outputs are concatenated, normalised and read by the head. The tables keep the default family's
names (`embeddings.<field>`, `wide.<field>` with `model.wide`), so id rows (`lora.trainable_tokens`) and
the batched serving stacks work as they do there; LoRA targets `cross_proj` and `deep_proj` (PEFT
matches target names as suffixes: the ModuleList index alone would not match).

Sizes come from the `model` config: `embed_dim` per field, `n_blocks` cross layers and as many deep
layers, deep width `embed_dim * ffn_mult * 2`. Written here, not taken from deepctr-torch: its releases
require TensorFlow, and its modules' names would not match the tables' above.
"""

from __future__ import annotations

import torch
from torch import nn

from pipelines.config import ModelConfig
from pipelines.data.schema import FEATURE_FIELDS
from pipelines.model.base import embedding_rows
from pipelines.model.features import field_sizes, token_sizes


class CrossLayer(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.cross_proj = nn.Linear(width, width)

    def forward(self, x0: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x0 * self.cross_proj(x) + x


class DeepLayer(nn.Module):
    def __init__(self, width_in: int, width_out: int, dropout: float):
        super().__init__()
        self.deep_proj = nn.Linear(width_in, width_out)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(torch.relu(self.deep_proj(x)))


class DCNModel(nn.Module):
    """Input: int64 tokens [batch, n_fields] (features.encode). Output: logits [batch]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        sizes = field_sizes(cfg)
        width, hidden = len(FEATURE_FIELDS) * cfg.embed_dim, cfg.embed_dim * cfg.ffn_mult * 2
        self.embeddings = nn.ModuleDict({f: nn.Embedding(sizes[f], cfg.embed_dim) for f in FEATURE_FIELDS})
        self.cross = nn.ModuleList(CrossLayer(width) for _ in range(cfg.n_blocks))
        self.deep = nn.ModuleList(
            DeepLayer(width if i == 0 else hidden, hidden, cfg.dropout) for i in range(cfg.n_blocks)
        )
        self.norm = nn.LayerNorm(width + hidden)
        self.head = nn.Linear(width + hidden, 1)
        for emb in self.embeddings.values():
            nn.init.normal_(emb.weight, std=0.02)
        if cfg.wide:  # after the rest, zero-initialised: as in the default family
            self.wide = nn.ModuleDict({f: nn.Embedding(n, 1) for f, n in token_sizes(cfg).items()})
            for emb in self.wide.values():
                nn.init.zeros_(emb.weight)
        else:
            self.wide = None

    def logits_and_pooled(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [batch], pooled [batch, F*D + hidden]: the normalised features the head reads)."""
        x0 = torch.cat(
            [self.embeddings[f](embedding_rows(self.cfg, tokens, i)) for i, f in enumerate(FEATURE_FIELDS)], dim=1
        )
        x = x0
        for layer in self.cross:
            x = layer(x0, x)
        d = x0
        for layer in self.deep:
            d = layer(d)
        h = self.norm(torch.cat([x, d], dim=1))
        logits = self.head(h).squeeze(-1)
        if self.wide is not None:
            logits = logits + torch.cat([self.wide[f](tokens[:, i]) for i, f in enumerate(FEATURE_FIELDS)], dim=1).sum(
                dim=1
            )
        return logits, h

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.logits_and_pooled(tokens)[0]
