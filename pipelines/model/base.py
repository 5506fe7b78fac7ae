"""The base CTR model: field embeddings -> self-attention blocks -> mean pool -> logit.

Attention projections are named `q_proj`, `k_proj`, `v_proj`, `o_proj` so that LoRA targets can be
named explicitly (PEFT `target_modules`), as in transformer LMs.

`ModelConfig.wide` (off by default; then the model, its state_dict keys and its weights for a seed
are exactly the original ones) adds a first-order term to that logit: one learned bias per field
value (`wide.<field>`, an Embedding of dim 1, zero-initialised), the "wide" part of Wide&Deep /
DeepFM, i.e. what a one-hot logistic regression learns. It sits outside the attention blocks: LoRA
on q_proj / v_proj adapts the same modules either way, and the wide tables stay frozen with the base.
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F
from torch import nn

from pipelines.config import ModelConfig
from pipelines.data.schema import FEATURE_FIELDS
from pipelines.model.features import ID_FIELDS, field_sizes, token_sizes


class AttentionBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, ffn_mult: int, dropout: float):
        super().__init__()
        self.n_heads = n_heads
        self.norm1 = nn.LayerNorm(dim)
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.o_proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.ffn_in = nn.Linear(dim, dim * ffn_mult)
        self.ffn_out = nn.Linear(dim * ffn_mult, dim)
        self.dropout = nn.Dropout(dropout)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        return x.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        q, k, v = self._heads(self.q_proj(h)), self._heads(self.k_proj(h)), self._heads(self.v_proj(h))
        att = F.scaled_dot_product_attention(q, k, v)
        att = att.transpose(1, 2).reshape(x.shape)
        x = x + self.dropout(self.o_proj(att))
        return x + self.dropout(self.ffn_out(F.gelu(self.ffn_in(self.norm2(x)))))


def embedding_rows(cfg: ModelConfig, tokens: torch.Tensor, i: int) -> torch.Tensor:
    """Field `i`'s embedding rows for `tokens`: the tokens, or an id field's modulo `id_buckets` when its
    tokens range over `wide_id_buckets` (features.token_sizes)."""
    if cfg.wide and cfg.wide_id_buckets and FEATURE_FIELDS[i] in ID_FIELDS:
        return tokens[:, i] % cfg.id_buckets
    return tokens[:, i]


class CTRModel(nn.Module):
    """Input: int64 tokens [batch, n_fields] (see features.encode). Output: logits [batch]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        sizes = field_sizes(cfg)
        self.embeddings = nn.ModuleDict({f: nn.Embedding(sizes[f], cfg.embed_dim) for f in FEATURE_FIELDS})
        self.field_pos = nn.Parameter(torch.zeros(len(FEATURE_FIELDS), cfg.embed_dim))
        self.blocks = nn.ModuleList(
            AttentionBlock(cfg.embed_dim, cfg.n_heads, cfg.ffn_mult, cfg.dropout) for _ in range(cfg.n_blocks)
        )
        self.norm = nn.LayerNorm(cfg.embed_dim)
        self.head = nn.Linear(cfg.embed_dim, 1)
        self._init()
        # Created after _init and zero-initialised: the other weights of a seed are the same with or without.
        if cfg.wide:
            self.wide = nn.ModuleDict({f: nn.Embedding(n, 1) for f, n in token_sizes(cfg).items()})
            for emb in self.wide.values():
                nn.init.zeros_(emb.weight)
        else:
            self.wide = None

    def _init(self) -> None:
        for emb in self.embeddings.values():
            nn.init.normal_(emb.weight, std=0.02)
        nn.init.normal_(self.field_pos, std=0.02)

    def field_embeddings(self, tokens: torch.Tensor) -> torch.Tensor:
        """[batch, n_fields, D]: each field's embedding row, before the field position is added."""
        return torch.stack(
            [self.embeddings[f](embedding_rows(self.cfg, tokens, i)) for i, f in enumerate(FEATURE_FIELDS)], dim=1
        )

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.field_embeddings(tokens) + self.field_pos

    def wide_logit(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """The first-order term [batch] (sum of the fields' value biases), None without `cfg.wide`."""
        if self.wide is None:
            return None
        return torch.cat([self.wide[f](tokens[:, i]) for i, f in enumerate(FEATURE_FIELDS)], dim=1).sum(dim=1)

    def logits_and_pooled(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [batch], pooled [batch, D]): the pooled vector is the mean over fields of the final
        LayerNorm's output, what the head reads; logits are exactly `forward(tokens)`."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        h = self.norm(x).mean(dim=1)
        logits = self.head(h).squeeze(-1)
        wide = self.wide_logit(tokens)
        return (logits if wide is None else logits + wide), h

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.logits_and_pooled(tokens)[0]


def fingerprint(model: nn.Module) -> str:
    """sha256 over the base weights (names, shapes, dtypes and bytes, in name order).

    LoRA-injected parameters and trainable token rows are excluded so a PEFT-wrapped base has the same
    fingerprint as the plain one; this is what ties an adapter to the exact base it was trained on.
    """
    h = hashlib.sha256()
    clean = {
        k.replace("base_model.model.", "").replace(".token_adapter", "").replace(".base_layer", ""): v
        for k, v in model.state_dict().items()
        if "lora_" not in k and "trainable_tokens_" not in k
    }
    for name in sorted(clean):
        t = clean[name].detach().cpu().contiguous()
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()
