"""A base whose wide part is a one-hot logistic regression (`base_training.wide_l2` > 0).

Trained jointly with the deep part for a few epochs of Adam, the wide term of Wide&Deep (`model.wide`:
one bias per field value) does not reach what a converged, L2-regularised one-hot LR learns, and the
network started 0.014 AUC below that LR on the backtest. So the base is fitted in two stages:

1. `fit_wide`: the wide tables of `base_training.wide_fields` and an intercept are fitted alone, full
   batch, to the optimum of an L2-regularised logistic regression (L-BFGS; the problem is convex). The
   penalty is `wide_l2 / 2 * ||w||^2` added to the *sum* of the log-losses, so `wide_l2` is 1 / C of
   sklearn's LogisticRegression. The intercept (unpenalised) is folded into the first fitted table
   (every row has exactly one value of each field), so the model gains no parameter.
2. `freeze_wide`: those tables freeze and the head's weights start at zero, so the model starts
   exactly at the LR; the deep part then trains on what the LR leaves (`base_training.epochs`; 0 keeps
   the LR alone).

Per-id freshness then lives where an LR keeps it: in the wide rows of users and items, which the
`delta` adapter kind moves (`model.adapters`).
"""
from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pipelines.data.schema import FEATURE_FIELDS
from pipelines.errors import ConfigError

log = logging.getLogger(__name__)


def wide_fields(model: nn.Module, fields: tuple[str, ...]) -> list[str]:
    """`fields` (default: every field) checked against the model's wide tables."""
    wide = getattr(model, "wide", None)
    if wide is None:
        raise ConfigError("base_training.wide_l2 > 0 fits the wide term as a logistic regression: set model.wide: true")
    picked = list(fields) or list(FEATURE_FIELDS)
    unknown = [f for f in picked if f not in wide]
    if unknown:
        raise ConfigError(f"base_training.wide_fields {unknown}: the model's wide tables are {sorted(wide)}")
    return picked


def fit_wide(model: nn.Module, tokens: np.ndarray, labels: np.ndarray, l2: float, fields: tuple[str, ...] = (),
             max_iter: int = 300) -> dict:
    """Fit `fields`' wide tables (the other tables are zeroed) and an intercept as an L2 logistic regression
    on all rows at once; returns {"loss", "iterations", "intercept"}."""
    picked = wide_fields(model, fields)
    cols = [FEATURE_FIELDS.index(f) for f in picked]
    x = torch.as_tensor(tokens[:, cols], dtype=torch.long)
    y = torch.as_tensor(labels, dtype=torch.float32)
    weights = [torch.zeros(model.wide[f].num_embeddings, dtype=torch.float64, requires_grad=True) for f in picked]
    intercept = torch.zeros((), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS(weights + [intercept], lr=1.0, max_iter=max_iter, history_size=20,
                            line_search_fn="strong_wolfe", tolerance_grad=1e-6, tolerance_change=1e-10)
    y64 = y.double()

    def closure():
        opt.zero_grad()
        z = intercept + sum(w[x[:, i]] for i, w in enumerate(weights))
        loss = F.binary_cross_entropy_with_logits(z, y64, reduction="sum")
        loss = loss + 0.5 * l2 * sum((w * w).sum() for w in weights)
        loss.backward()
        return loss

    loss = float(opt.step(closure).detach())
    iterations = opt.state[opt._params[0]].get("n_iter", 0)
    with torch.no_grad():
        for f, table in model.wide.items():
            table.weight.zero_()
        for f, w in zip(picked, weights):
            model.wide[f].weight[:, 0] = w.float()
        model.wide[picked[0]].weight.add_(intercept.float())   # each row has one value of every field
    log.info("wide LR (l2 %g, fields %s): penalised loss %.2f over %d rows after %d L-BFGS iterations", l2, picked,
             loss, len(y), iterations)
    return {"loss": loss, "iterations": int(iterations), "intercept": float(intercept.detach())}


def freeze_wide(model: nn.Module) -> None:
    """Freeze the wide tables and zero the head, so the deep part starts as no change to the LR's logit."""
    model.wide.requires_grad_(False)
    head = getattr(model, "head", None)
    if isinstance(head, nn.Linear):
        with torch.no_grad():
            head.weight.zero_()
            if head.bias is not None:
                head.bias.zero_()
