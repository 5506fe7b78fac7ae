"""Metric functions on (labels, predicted probabilities). scikit-learn computes them; we only guard
the degenerate cases that make sklearn raise (a single class) so callers get NaN and a clear check."""
from __future__ import annotations

import math

import numpy as np
from sklearn.metrics import log_loss, roc_auc_score


def auc(y: np.ndarray, p: np.ndarray) -> float:
    y = np.asarray(y)
    if len(y) == 0 or y.min() == y.max():
        return float("nan")
    return float(roc_auc_score(y, p))


def logloss(y: np.ndarray, p: np.ndarray) -> float:
    if len(y) == 0:
        return float("nan")
    return float(log_loss(np.asarray(y), np.clip(np.asarray(p, dtype=np.float64), 1e-7, 1 - 1e-7), labels=[0, 1]))


def summary(y: np.ndarray, p: np.ndarray) -> dict:
    """JSON-safe metric dict (NaN becomes None)."""
    out = {"auc": auc(y, p), "logloss": logloss(y, p), "rows": int(len(y)),
           "ctr": float(np.mean(y)) if len(y) else None, "mean_pctr": float(np.mean(p)) if len(p) else None}
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in out.items()}
