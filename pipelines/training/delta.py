"""How an adapter of `lora` is trained: the loop's settings and the penalties on its loss.

A `delta` adapter (`lora.kind: delta`, model.adapters) holds per-id rows of the base's wide term. Its
offsets (row - the base's row) are anchored to zero by an L2 penalty (`Anchor`) on the scale of a
logistic regression's: `delta_l2 / 2 * ||offsets||^2` per sum of the rows' log-losses, so per batch (whose
loss is a mean) the penalty is divided by the training rows. The ids of a window appear a few times each,
so their rows train with Adagrad, whose per-coordinate steps follow each row's own gradient history.
"""

from __future__ import annotations

import torch
from torch import nn

from pipelines.config import LoraTrainConfig
from pipelines.training.loop import LoopSettings


def loop_settings(lc: LoraTrainConfig) -> LoopSettings:
    """The training loop's settings for an adapter of `lc` (the stability rule's lr; Adagrad for a delta)."""
    return LoopSettings(
        lc.epochs,
        lc.batch_size,
        lc.stable_lr(),
        lc.weight_decay,
        lc.warmup_steps,
        lc.seed,
        patience=lc.early_stopping_patience,
        start_is_candidate=lc.keep_base_if_no_gain,
        optimizer="adagrad" if lc.kind == "delta" else "adamw",
    )


class Anchor:
    """`l2 / (2 * rows) * sum ||trained row - base row||^2` over the model's trainable token rows."""

    def __init__(self, l2: float, rows: int) -> None:
        if rows <= 0:
            raise ValueError("Anchor: no training rows")
        self.scale = l2 / (2.0 * rows)

    def __call__(self, model: nn.Module) -> torch.Tensor:
        total = torch.zeros(())
        for module in model.modules():
            rows = getattr(module, "trainable_tokens_delta", None)
            if rows is None or getattr(module, "tied_adapter", None) is not None:
                continue
            for name, value in rows.items():
                if value.requires_grad:
                    total = total + (value - module.trainable_tokens_original[name]).pow(2).sum()
        return self.scale * total


def regularizer(lc: LoraTrainConfig, rows: int, orthogonality=None):
    """The penalty `fit` adds to every batch's loss: the delta's anchor, the orthogonality penalty, both
    (summed) or neither (None)."""
    parts = [
        p
        for p in (Anchor(lc.delta_l2, rows) if lc.kind == "delta" and lc.delta_l2 > 0 else None, orthogonality)
        if p is not None
    ]
    if len(parts) <= 1:
        return parts[0] if parts else None
    return lambda model: sum(p(model) for p in parts)
