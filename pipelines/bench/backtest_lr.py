"""The logistic-regression comparators of the backtest: the references a daily network must beat.

* ``lr_static``: the one-hot LR (`fit_lr`: one-hot `LR_FEATURES`, L2 strength 1 / C) fitted once, on the
  history of the first scored day;
* ``lr_daily``: the same LR refitted every day on all earlier rows;
* ``lr_delta``: ``lr_static`` plus a per-id additive delta retrained every morning on the trailing
  `DELTA_WINDOW_DAYS`: one weight per user, per item and per (user, slot), fitted with the frozen LR's
  logit as offset and an L2 penalty that anchors every delta to zero (`fit_delta`). It is what "freshness
  lives in the per-id weights" (FTRL at Google, Monolith at ByteDance) means for an LR, and the reference
  our `delta` adapter kind must beat.

C is chosen once for all three (`tune_lr` over `LR_C_GRID`), on the latest `VAL_FRACTION` of the first day's
history, as the retired static benchmark chose it. The delta's L2 (`DELTA_L2`) was chosen on the validation
days (docs/benchmarks.md).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from scipy import sparse
from scipy.optimize import minimize
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import OneHotEncoder

from pipelines.bench.backtest_models import Comparator
from pipelines.bench.backtest_protocol import VAL_FRACTION, Backtest, Day, temporal_split
from pipelines.metrics import auc

LR_FEATURES = ("user_id", "item_id", "gender", "age_bucket", "occupation", "category", "slot")
LR_C_GRID = (0.03, 0.1, 0.3, 1.0, 3.0)

DELTA_WINDOW_DAYS = 7
# The L2 strength of the delta (penalty DELTA_L2 / 2 * ||delta||^2 added to the *sum* of the window's
# log-losses, so 1 / DELTA_L2 is sklearn's C), chosen on the validation days over (1, 3, 10, 30).
DELTA_L2 = 10.0
DELTA_KEYS = ("user", "item")


def _lr_pipeline(C: float):
    return make_pipeline(OneHotEncoder(handle_unknown="ignore"), LogisticRegression(C=C, max_iter=3000))


def _lr_x(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[list(LR_FEATURES)].astype(str)


def fit_lr(train: pd.DataFrame, C: float):
    return _lr_pipeline(C).fit(_lr_x(train), train["label"].to_numpy())


def predict_lr(model, frame: pd.DataFrame) -> np.ndarray:
    return model.predict_proba(_lr_x(frame))[:, 1]


def tune_lr(fit: pd.DataFrame, val: pd.DataFrame, grid=LR_C_GRID) -> tuple[float, dict]:
    """(the C of `grid` with the best AUC on `val` when fitted on `fit`, {str(C): val AUC})."""
    yv = val["label"].to_numpy()
    val_auc = {C: auc(yv, predict_lr(fit_lr(fit, C), val)) for C in grid}
    return max(val_auc, key=val_auc.get), {str(C): round(a, 4) for C, a in val_auc.items()}


class _LrBase(Comparator):
    """Holds C (chosen before the first scored day) and the LR fitted at the cut."""

    def __init__(self, C: float | None = None) -> None:
        super().__init__()
        self.C = C
        self.val_auc: dict | None = None
        self.at_cut = None

    def _choose_c(self, history: pd.DataFrame) -> None:
        if self.C is None:
            fit, val = temporal_split(history, 1.0 - VAL_FRACTION)
            self.C, self.val_auc = tune_lr(fit, val)

    def _static(self, bt: Backtest):
        if self.at_cut is None:
            history = bt.history(bt.days[0])
            self._choose_c(history)
            self.at_cut = self._timed(fit_lr, history, self.C)
        return self.at_cut

    def info(self) -> dict:
        return {"C": self.C, "val_auc_by_C": self.val_auc}


class LrStatic(_LrBase):
    name = "lr_static"

    def predict_day(self, bt: Backtest, day: Day) -> np.ndarray:
        return predict_lr(self._static(bt), bt.scored(day))


class LrDaily(_LrBase):
    name = "lr_daily"

    def predict_day(self, bt: Backtest, day: Day) -> np.ndarray:
        history = bt.history(day)
        self._choose_c(history)
        model = self._timed(fit_lr, history, self.C)
        return predict_lr(model, bt.scored(day))


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
