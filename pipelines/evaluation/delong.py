"""DeLong's test for two correlated AUCs (same rows), in the O(n log n) form of Sun & Xu (2014),
"Fast Implementation of DeLong's Algorithm for Comparing the Areas Under Correlated ROC Curves".

Each AUC is the mean of its structural components: for a positive x, V10(x) = share of negatives it
out-scores; for a negative y, V01(y) = share of positives that out-score it (ties count 1/2, which
is what midranks give). Sun & Xu get them from three midrank passes instead of the m*n pair table:
  V10 = (rank of x among all rows - rank of x among positives) / n
  V01 = 1 - (rank of y among all rows - rank of y among negatives) / m
Cov(AUC) = S10 / m + S01 / n with S10, S01 the sample covariance matrices of V10, V01 across models.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.stats import norm, rankdata

from pipelines.metrics import EvaluationInputError


def _checked(y, scores: list, where: str) -> tuple[np.ndarray, np.ndarray]:
    """(labels as bool, scores [k, rows] float64); raises EvaluationInputError on unusable input."""
    y = np.asarray(y, dtype=np.float64).ravel()
    if not np.isin(y, (0.0, 1.0)).all():
        raise EvaluationInputError(f"{where}: labels must be 0/1")
    rows = []
    for i, s in enumerate(scores):
        s = np.asarray(s, dtype=np.float64).ravel()
        if len(s) != len(y):
            raise EvaluationInputError(f"{where}: score vector {i} has {len(s)} values for {len(y)} labels")
        if not np.isfinite(s).all():
            raise EvaluationInputError(f"{where}: score vector {i} has {int((~np.isfinite(s)).sum())} NaN/inf values")
        rows.append(s)
    n_pos, n_neg = int(y.sum()), int(len(y) - y.sum())
    # one row per class leaves a covariance with 0 degrees of freedom: the variance is undefined
    if n_pos < 2 or n_neg < 2:
        raise EvaluationInputError(
            f"{where}: needs at least 2 positive and 2 negative rows, got {n_pos} positive / {n_neg} negative"
        )
    return y.astype(bool), np.vstack(rows)


def structural_components(y, scores: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(aucs [k], v10 [k, n_pos], v01 [k, n_neg]) for k score vectors on the same rows."""
    pos, s = _checked(y, scores, "delong")
    x, z = s[:, pos], s[:, ~pos]
    m, n = x.shape[1], z.shape[1]
    tx = rankdata(x, axis=1)  # midranks: ties share the mean rank
    tz = rankdata(z, axis=1)
    t_all = rankdata(np.hstack([x, z]), axis=1)
    v10 = (t_all[:, :m] - tx) / n
    v01 = 1.0 - (t_all[:, m:] - tz) / m
    aucs = v10.mean(axis=1)  # == (sum of positive ranks - m(m+1)/2) / (m n)
    return aucs, v10, v01


def covariance(v10: np.ndarray, v01: np.ndarray) -> np.ndarray:
    """DeLong covariance matrix [k, k] of the k AUCs."""
    m, n = v10.shape[1], v01.shape[1]
    s10 = np.atleast_2d(np.cov(v10, ddof=1))
    s01 = np.atleast_2d(np.cov(v01, ddof=1))
    return s10 / m + s01 / n


def auc_ci(y, p, level: float = 0.95) -> dict:
    """One AUC with its DeLong standard error and Wald interval (clipped to [0, 1])."""
    if not 0.0 < level < 1.0:
        raise EvaluationInputError(f"auc_ci: level must be in (0, 1), got {level}")
    aucs, v10, v01 = structural_components(y, [p])
    se = math.sqrt(max(float(covariance(v10, v01)[0, 0]), 0.0))
    q = float(norm.ppf(0.5 + level / 2))
    a = float(aucs[0])
    return {
        "auc": a,
        "se": se,
        "ci": [max(a - q * se, 0.0), min(a + q * se, 1.0)],
        "level": level,
        "n_pos": int(v10.shape[1]),
        "n_neg": int(v01.shape[1]),
    }


def _z_and_p(diff: float, se: float) -> tuple[float | None, float]:
    # se == 0 happens when neither ranking has any spread to test (e.g. identical scores):
    # no difference -> p = 1; a difference with zero variance (both AUCs 0 or 1) -> p = 0, z = None
    # (infinite, not JSON-safe).
    if se > 0.0:
        z = diff / se
        return z, float(2.0 * norm.sf(abs(z)))
    return (0.0, 1.0) if diff == 0.0 else (None, 0.0)


def delong_test(y, p_a, p_b) -> dict:
    """Two-sided DeLong test of AUC(a) == AUC(b) on the same rows. diff = auc_a - auc_b.

    JSON-safe: {"auc_a", "auc_b", "diff", "var_a", "var_b", "cov", "se", "ci95": [low, high], "z",
    "p_value", "n_pos", "n_neg"}; ci95 is the Wald interval diff +- 1.96 se.
    """
    aucs, v10, v01 = structural_components(y, [p_a, p_b])
    c = covariance(v10, v01)
    diff = float(aucs[0] - aucs[1])
    # clamp: rounding can take a true 0 variance slightly negative
    se = math.sqrt(max(float(c[0, 0] + c[1, 1] - 2 * c[0, 1]), 0.0))
    z, p_value = _z_and_p(diff, se)
    q = float(norm.ppf(0.975))
    return {
        "auc_a": float(aucs[0]),
        "auc_b": float(aucs[1]),
        "diff": diff,
        "var_a": float(c[0, 0]),
        "var_b": float(c[1, 1]),
        "cov": float(c[0, 1]),
        "se": se,
        "ci95": [diff - q * se, diff + q * se],
        "z": None if z is None else float(z),
        "p_value": p_value,
        "n_pos": int(v10.shape[1]),
        "n_neg": int(v01.shape[1]),
    }
