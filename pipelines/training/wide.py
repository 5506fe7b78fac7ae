"""A base whose wide part is a one-hot logistic regression (`base_training.wide_l2` > 0).

Trained jointly with the deep part for a few epochs of Adam, the wide term of Wide&Deep (`model.wide`:
one bias per field value) does not reach what a converged, L2-regularised one-hot LR learns, and the
network started 0.014 AUC below that LR on the backtest. So the base is fitted in two stages:

1. `fit_wide`: the wide tables of `base_training.wide_fields` and an intercept are fitted alone, full
   batch, to the optimum of an L2-regularised logistic regression (L-BFGS; the problem is convex). The
   penalty is `wide_l2 / 2 * ||w||^2` added to the *sum* of the log-losses, so `wide_l2` is 1 / C of
   sklearn's LogisticRegression. The intercept (unpenalised) is folded into the first fitted table
   (every row has exactly one value of each field), so the model gains no parameter.
   With `base_training.wide_l2_grid` the L2 is chosen first (`choose_l2`): each candidate fitted on the
   oldest rows, the one whose LR ranks the newest `holdout_fraction` of them best (AUC) is refitted on
   every row, as the backtest's `lr_static` chooses its C. A fixed L2 was right at one validation cut
   and 0.003-0.006 AUC wrong at two earlier ones (docs/benchmarks.md).
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
from pipelines.metrics import auc

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


def fit_wide(
    model: nn.Module,
    tokens: np.ndarray,
    labels: np.ndarray,
    l2: float,
    fields: tuple[str, ...] = (),
    max_iter: int = 1000,
    start_intercept: float | None = None,
) -> dict:
    """Fit `fields`' wide tables (the other tables are zeroed) and an intercept as an L2 logistic regression
    on all rows at once; returns {"loss", "iterations", "intercept"}. `start_intercept`: start L-BFGS from
    the fit the tables hold now (of the same fields), whose intercept that was; the optimum is the same
    (the problem is convex), reached in fewer steps from a nearby L2 or a subset of the rows.

    The problem is solved over the values the rows hold, one weight each (as a one-hot encoder's columns),
    and scattered into the tables: a row no training row holds has no loss term, so its optimum is 0, and
    L-BFGS's cost follows the distinct values, not the table's size (`model.wide_id_buckets`)."""
    picked = wide_fields(model, fields)
    cols = [np.unique(tokens[:, FEATURE_FIELDS.index(f)], return_inverse=True) for f in picked]
    x = [torch.as_tensor(inverse.reshape(-1), dtype=torch.long) for _, inverse in cols]
    weights, intercept = _start(model, picked, [values for values, _ in cols], start_intercept)
    opt = torch.optim.LBFGS(
        weights + [intercept],
        lr=1.0,
        max_iter=max_iter,
        history_size=20,
        line_search_fn="strong_wolfe",
        tolerance_grad=1e-3,
        tolerance_change=1e-6,
    )
    y64 = torch.as_tensor(labels, dtype=torch.float64)
    last = {}

    def closure():
        opt.zero_grad()
        z = intercept + sum(w[xi] for xi, w in zip(x, weights))
        loss = F.binary_cross_entropy_with_logits(z, y64, reduction="sum")
        loss = loss + 0.5 * l2 * sum((w * w).sum() for w in weights)
        loss.backward()
        last["loss"] = float(loss.detach())
        return loss

    opt.step(closure)
    iterations = opt.state[opt._params[0]].get("n_iter", 0)
    with torch.no_grad():
        for f, table in model.wide.items():
            table.weight.zero_()
        for f, (values, _), w in zip(picked, cols, weights):
            model.wide[f].weight[torch.as_tensor(values, dtype=torch.long), 0] = w.float()
        model.wide[picked[0]].weight.add_(intercept.float())  # each row has one value of every field
    log.info(
        "wide LR (l2 %g, fields %s): penalised loss %.2f over %d rows after %d L-BFGS iterations",
        l2,
        picked,
        last["loss"],
        len(labels),
        iterations,
    )
    return {"loss": last["loss"], "iterations": int(iterations), "intercept": float(intercept.detach())}


def _start(model: nn.Module, picked: list[str], values: list[np.ndarray], intercept: float | None):
    """L-BFGS's first point: zeros, or the weights the tables hold at `values` (the intercept taken back
    out of the first table, where `fit_wide` folds it)."""
    if intercept is None:
        return (
            [torch.zeros(len(v), dtype=torch.float64, requires_grad=True) for v in values],
            torch.zeros((), dtype=torch.float64, requires_grad=True),
        )
    with torch.no_grad():
        weights = [
            model.wide[f].weight[torch.as_tensor(v, dtype=torch.long), 0].double() for f, v in zip(picked, values)
        ]
        weights[0] -= intercept
    return (
        [w.clone().requires_grad_(True) for w in weights],
        torch.tensor(float(intercept), dtype=torch.float64, requires_grad=True),
    )


def choose_l2(
    model: nn.Module,
    tokens: np.ndarray,
    labels: np.ndarray,
    grid: tuple[float, ...],
    newest_fraction: float,
    fields: tuple[str, ...] = (),
) -> tuple[float, dict[str, float], float]:
    """(the L2 of `grid` whose LR, fitted on the oldest rows, has the best AUC on the newest
    `newest_fraction` of them, {str(l2): that AUC}, that fit's intercept); the rows are in event-time
    order. Ties: the larger L2. The grid is fitted from the largest L2 down, each fit starting from the
    last (a regularisation path), and the model is left holding the chosen fit, a start for the caller's
    fit on every row (`fit_wide(start_intercept=...)`)."""
    cut = int(round(len(labels) * (1.0 - newest_fraction)))
    if cut < 1 or cut >= len(labels) or len(np.unique(labels[cut:])) < 2:
        raise ConfigError(
            f"base_training.wide_l2_grid: {len(labels)} rows leave no newest {newest_fraction:.0%} "
            "with both labels to choose the L2 on"
        )
    scores, best, intercept = {}, None, None
    for l2 in sorted(grid, reverse=True):
        intercept = fit_wide(model, tokens[:cut], labels[:cut], l2, fields, start_intercept=intercept)["intercept"]
        with torch.no_grad():
            z = model.wide_logit(torch.as_tensor(tokens[cut:], dtype=torch.long)).numpy()
        scores[str(l2)] = round(auc(labels[cut:], z), 6)
        if best is None or scores[str(l2)] > scores[str(best[0])]:
            best = (l2, intercept, {f: t.weight.detach().clone() for f, t in model.wide.items()})
    l2, intercept, tables = best
    with torch.no_grad():
        for f, weight in tables.items():
            model.wide[f].weight.copy_(weight)
    log.info("wide LR: l2 %g chosen on the newest %d rows (AUC by l2: %s)", l2, len(labels) - cut, scores)
    return l2, scores, intercept


def freeze_wide(model: nn.Module) -> None:
    """Freeze the wide tables and zero the head, so the deep part starts as no change to the LR's logit."""
    model.wide.requires_grad_(False)
    head = getattr(model, "head", None)
    if isinstance(head, nn.Linear):
        with torch.no_grad():
            head.weight.zero_()
            if head.bias is not None:
                head.bias.zero_()
