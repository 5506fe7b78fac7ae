"""The logistic-regression comparators of the backtest: the references a daily network must beat.

* ``lr_static``: the one-hot LR of `quality_protocol` fitted once, on the history of the first scored day;
* ``lr_daily``: the same LR refitted every day on all earlier rows;
* ``lr_delta``: ``lr_static`` plus a per-id additive delta retrained every morning on the trailing
  `DELTA_WINDOW_DAYS`: one weight per user, per item and per (user, slot), fitted with the frozen LR's
  logit as offset and an L2 penalty that anchors every delta to zero (`fit_delta`). It is what "freshness
  lives in the per-id weights" (FTRL at Google, Monolith at ByteDance) means for an LR, and the reference
  our `delta` adapter kind must beat.

C is chosen once for all three, on the latest 10% of the first day's history, as the static benchmark
chooses it. The delta's L2 (`DELTA_L2`) was chosen on the validation days (docs/benchmarks.md).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from pipelines.bench.backtest_models import Comparator
from pipelines.bench.backtest_protocol import Backtest, Day

DELTA_WINDOW_DAYS = 7
# The L2 strength of the delta (penalty DELTA_L2 / 2 * ||delta||^2 added to the *sum* of the window's
# log-losses, so 1 / DELTA_L2 is sklearn's C), chosen on the validation days over (1, 3, 10, 30).
DELTA_L2 = 10.0
DELTA_KEYS = ("user", "item")


class _LrBase(Comparator):
    """Holds C (chosen before the first scored day) and the LR fitted at the cut."""

    def __init__(self, C: float | None = None) -> None:
        super().__init__()
        self.C = C
        self.val_auc: dict | None = None
        self.at_cut = None

    def _choose_c(self, history: pd.DataFrame) -> None:
        from pipelines.bench import quality_protocol as qp

        if self.C is None:
            fit, val = qp.temporal_split(history, 1.0 - qp.VAL_FRACTION)
            self.C, self.val_auc = qp.tune_lr(fit, val)

    def _static(self, bt: Backtest):
        from pipelines.bench import quality_protocol as qp

        if self.at_cut is None:
            history = bt.history(bt.days[0])
            self._choose_c(history)
            self.at_cut = self._timed(qp.fit_lr, history, self.C)
        return self.at_cut

    def info(self) -> dict:
        return {"C": self.C, "val_auc_by_C": self.val_auc}


class LrStatic(_LrBase):
    name = "lr_static"

    def predict_day(self, bt: Backtest, day: Day) -> np.ndarray:
        from pipelines.bench import quality_protocol as qp

        return qp.predict_lr(self._static(bt), bt.scored(day))


class LrDaily(_LrBase):
    name = "lr_daily"

    def predict_day(self, bt: Backtest, day: Day) -> np.ndarray:
        from pipelines.bench import quality_protocol as qp

        history = bt.history(day)
        self._choose_c(history)
        model = self._timed(qp.fit_lr, history, self.C)
        return qp.predict_lr(model, bt.scored(day))


class LrDelta(_LrBase):
    name = "lr_delta"

    def __init__(self, C: float | None = None, l2: float = DELTA_L2, window_days: int = DELTA_WINDOW_DAYS) -> None:
        super().__init__(C)
        self.l2, self.window_days = l2, window_days
        self.deltas: list[int] = []

    def predict_day(self, bt: Backtest, day: Day) -> np.ndarray:
        base = self._static(bt)
        rows = bt.scored(day)
        offset = base.decision_function(_lr_x(rows))
        window = bt.window(day, self.window_days)
        if window.empty:
            return _sigmoid(offset)
        index, delta = self._timed(fit_delta, window, base.decision_function(_lr_x(window)), self.l2)
        self.deltas.append(len(index))
        return _sigmoid(offset + _design(rows, index) @ delta)

    def info(self) -> dict:
        return {
            **super().info(),
            "l2": self.l2,
            "window_days": self.window_days,
            "deltas_mean": int(np.mean(self.deltas)) if self.deltas else None,
        }


def _lr_x(frame: pd.DataFrame):
    from pipelines.bench.quality_protocol import LR_FEATURES

    return frame[list(LR_FEATURES)].astype(str)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


def _keys(rows: pd.DataFrame) -> dict[str, np.ndarray]:
    user = rows["user_id"].astype(str).to_numpy()
    keys = {
        "user": user,
        "item": rows["item_id"].astype(str).to_numpy(),
        "user_slot": np.char.add(np.char.add(user.astype(str), "|"), rows["slot"].astype(str).to_numpy().astype(str)),
    }
    return {k: keys[k] for k in DELTA_KEYS}


def _design(rows: pd.DataFrame, index: dict[tuple[str, str], int]):
    """Sparse [rows, len(index)]: a 1 in the column of each of a row's delta keys that `index` holds."""
    from scipy import sparse

    r, c = [], []
    for kind, values in _keys(rows).items():
        for i, v in enumerate(values):
            j = index.get((kind, v))
            if j is not None:
                r.append(i)
                c.append(j)
    return sparse.csr_matrix((np.ones(len(r)), (r, c)), shape=(len(rows), len(index)))


def fit_delta(window: pd.DataFrame, offset: np.ndarray, l2: float) -> tuple[dict, np.ndarray]:
    """The per-id deltas of `window`'s rows: argmin over d of sum(logloss(offset + X d)) + l2/2 ||d||^2,
    X the one-hot of each row's user, item and (user, slot) (L-BFGS; the problem is strictly convex).
    Returns ({(kind, id): column}, d)."""
    from scipy.optimize import minimize

    index: dict[tuple[str, str], int] = {}
    for kind, values in _keys(window).items():
        for v in pd.unique(values):
            index[(kind, v)] = len(index)
    x = _design(window, index)
    y = window["label"].to_numpy(dtype=np.float64)

    def loss(d: np.ndarray) -> tuple[float, np.ndarray]:
        z = offset + x @ d
        p = _sigmoid(z)
        value = float(np.sum(np.logaddexp(0.0, z) - y * z)) + 0.5 * l2 * float(d @ d)
        return value, x.T @ (p - y) + l2 * d

    out = minimize(loss, np.zeros(len(index)), jac=True, method="L-BFGS-B", options={"maxiter": 500})
    return index, out.x
