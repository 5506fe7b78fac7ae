"""How a base is fitted, wherever one is (the base stage, the backtest's static and daily bases): the
training loop over every parameter, after the wide term's logistic regression when
`base_training.wide_l2` > 0 (`training.wide`; its L2 chosen on the rows' newest `holdout_fraction` when
`wide_l2_grid` names candidates). The rows come in event-time order."""

from __future__ import annotations

import numpy as np
from torch import nn

from pipelines.config import BaseTrainConfig
from pipelines.training.loop import LoopSettings, seed_everything, train
from pipelines.training.wide import choose_l2, fit_wide, freeze_wide


def fit_base(
    model: nn.Module,
    tokens: np.ndarray,
    labels: np.ndarray,
    bt: BaseTrainConfig,
    *,
    val=None,
    desc: str = "base",
    on_epoch=None,
) -> dict:
    """Train `model` (fresh, pretrained weights loaded) on the rows as `bt` says; returns
    {"wide": the LR fit's report or None, "history": the loop's per-epoch metrics}."""
    seed_everything(bt.seed)
    wide = None
    if bt.wide_l2 > 0:
        l2, by_l2, start = bt.wide_l2, None, None
        if bt.wide_l2_grid:
            l2, by_l2, start = choose_l2(model, tokens, labels, bt.wide_l2_grid, bt.holdout_fraction, bt.wide_fields)
        wide = {**fit_wide(model, tokens, labels, l2, bt.wide_fields, start_intercept=start), "l2": l2}
        if by_l2:
            wide["auc_by_l2"] = by_l2
        freeze_wide(model)
    history = []
    if bt.epochs > 0:
        settings = LoopSettings(bt.epochs, bt.batch_size, bt.lr, bt.weight_decay, bt.warmup_steps, bt.seed)
        history = train(model, tokens, labels, settings, val=val, desc=desc, on_epoch=on_epoch)
    model.requires_grad_(True)
    return {"wide": wide, "history": history}
