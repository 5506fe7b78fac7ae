"""Metric functions on (labels, predicted probabilities). scikit-learn computes them; we only guard
the degenerate cases that make sklearn raise (a single class) so callers get NaN and a clear check.

Added here: normalized entropy, calibration ratio, the reliability curve and its ECE, and GAUC.
What sklearn lacks (bin counts, per-user AUC over millions of rows) is hand-written and tested
against sklearn or a brute-force loop.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
import pandas as pd
from sklearn.metrics import log_loss, roc_auc_score

from pipelines.errors import PipelineError

BinStrategy = Literal["quantile", "uniform"]
_EPS = 1e-7  # the clip logloss uses; also keeps the background entropy of a 0/1 CTR at exactly 0


class EvaluationInputError(PipelineError, ValueError):
    """Labels, scores or groups handed to an evaluation function are unusable (names what is wrong)."""


def check_inputs(y, p, where: str = "metrics") -> tuple[np.ndarray, np.ndarray]:
    """1-D float64 copies of labels and scores, or EvaluationInputError naming the problem.

    Labels must be 0/1 and scores finite probabilities in [0, 1]: a NaN score would otherwise rank
    arbitrarily in sklearn's sort and silently move the AUC.
    """
    y = np.asarray(y, dtype=np.float64).ravel()
    p = np.asarray(p, dtype=np.float64).ravel()
    if len(y) != len(p):
        raise EvaluationInputError(f"{where}: {len(y)} labels but {len(p)} scores")
    if len(y) and not np.isin(y, (0.0, 1.0)).all():
        bad = np.unique(y[~np.isin(y, (0.0, 1.0))])[:5]
        raise EvaluationInputError(f"{where}: labels must be 0/1, got values {bad}")
    if not np.isfinite(p).all():
        raise EvaluationInputError(f"{where}: {int((~np.isfinite(p)).sum())} scores are NaN or infinite")
    if len(p) and (p.min() < 0.0 or p.max() > 1.0):
        raise EvaluationInputError(f"{where}: scores must be probabilities in [0, 1], got [{p.min():g}, {p.max():g}]")
    return y, p


def auc(y: np.ndarray, p: np.ndarray) -> float:
    y = np.asarray(y)
    if len(y) == 0 or y.min() == y.max():
        return float("nan")
    return float(roc_auc_score(y, p))


def logloss(y: np.ndarray, p: np.ndarray) -> float:
    if len(y) == 0:
        return float("nan")
    return float(log_loss(np.asarray(y), np.clip(np.asarray(p, dtype=np.float64), _EPS, 1 - _EPS), labels=[0, 1]))


def _binary_entropy(c: float) -> float:
    if c <= 0.0 or c >= 1.0:
        return 0.0
    return -(c * math.log(c) + (1 - c) * math.log(1 - c))


def normalized_entropy(y: np.ndarray, p: np.ndarray) -> float:
    """Logloss divided by the entropy of always predicting the background CTR (He et al. 2014).

    < 1 means the model beats the constant base-rate predictor. NaN when there are no rows or the
    labels are all one class (the background entropy is 0, nothing to normalise by).
    """
    y, p = check_inputs(y, p, "normalized_entropy")
    h = _binary_entropy(float(y.mean())) if len(y) else 0.0
    return logloss(y, p) / h if h > 0.0 else float("nan")


def calibration_ratio(y: np.ndarray, p: np.ndarray) -> float:
    """mean(p) / mean(y): 1 is calibrated on average, > 1 over-predicts. NaN without a click."""
    y, p = check_inputs(y, p, "calibration_ratio")
    return float(p.mean() / y.mean()) if len(y) and y.mean() > 0 else float("nan")


def _bin_ids(p: np.ndarray, bins: int, strategy: BinStrategy) -> np.ndarray:
    # Same edges and assignment as sklearn.calibration.calibration_curve (tested to match), so the
    # curve is sklearn's, with the per-bin counts sklearn does not return.
    if strategy == "quantile":
        edges = np.percentile(p, np.linspace(0.0, 1.0, bins + 1) * 100)
    else:
        edges = np.linspace(0.0, 1.0, bins + 1)
    return np.searchsorted(edges[1:-1], p)


def reliability_curve(y: np.ndarray, p: np.ndarray, bins: int = 10, strategy: BinStrategy = "quantile") -> dict:
    """Per bin: mean predicted CTR, observed click rate, row count (empty bins dropped).

    Quantile bins by default: at a 1-5 % CTR uniform bins on [0, 1] put nearly every row in the first
    bin, while quantile bins hold ~equal row counts where the predictions actually are. Ties in the
    scores can merge quantile edges, so fewer than `bins` bins may come back.
    """
    y, p = check_inputs(y, p, "reliability_curve")
    if strategy not in ("quantile", "uniform"):
        raise EvaluationInputError(f"reliability_curve: strategy must be 'quantile' or 'uniform', got {strategy!r}")
    if bins < 1:
        raise EvaluationInputError(f"reliability_curve: bins must be >= 1, got {bins}")
    out = {"strategy": strategy, "bins": int(bins), "mean_predicted": [], "observed_rate": [], "count": []}
    if not len(y):
        return out
    ids = _bin_ids(p, bins, strategy)
    count = np.bincount(ids, minlength=bins)
    pred_sum = np.bincount(ids, weights=p, minlength=bins)
    true_sum = np.bincount(ids, weights=y, minlength=bins)
    keep = count > 0
    out["mean_predicted"] = [float(v) for v in pred_sum[keep] / count[keep]]
    out["observed_rate"] = [float(v) for v in true_sum[keep] / count[keep]]
    out["count"] = [int(v) for v in count[keep]]
    return out


def expected_calibration_error(
    y: np.ndarray, p: np.ndarray, bins: int = 10, strategy: BinStrategy = "quantile"
) -> float:
    """Row-weighted mean over bins of |observed rate - mean predicted|. NaN without rows."""
    curve = reliability_curve(y, p, bins, strategy)
    n = sum(curve["count"])
    if n == 0:
        return float("nan")
    gaps = np.abs(np.array(curve["observed_rate"]) - np.array(curve["mean_predicted"]))
    return float(np.dot(gaps, curve["count"]) / n)


def gauc(y: np.ndarray, p: np.ndarray, user_ids) -> dict:
    """Group AUC: per-user AUC averaged with weights = the user's impressions (Zhou et al., DIN).

    Users with only clicks or only non-clicks have no AUC and are skipped (counted). Per-user AUCs
    come from within-user midranks in one vectorised pass (the Mann-Whitney form, ties count 1/2)
    rather than one sklearn call per user, which is too slow for a day of users.
    Returns {"gauc", "users_used", "users_skipped", "rows_used"}; gauc is None when no user counts.
    """
    y, p = check_inputs(y, p, "gauc")
    users = pd.Series(user_ids).astype("string").fillna("<null>").to_numpy(dtype=object)
    if len(users) != len(y):
        raise EvaluationInputError(f"gauc: {len(users)} user ids but {len(y)} labels")
    if not len(y):
        return {"gauc": None, "users_used": 0, "users_skipped": 0, "rows_used": 0}
    df = pd.DataFrame({"u": users, "y": y, "p": p})
    df["rank"] = df.groupby("u", sort=False)["p"].rank(method="average")
    g = (
        df.assign(rank_pos=df["rank"] * df["y"])
        .groupby("u", sort=False)
        .agg(n=("y", "size"), pos=("y", "sum"), rank_pos=("rank_pos", "sum"))
    )
    neg = g["n"] - g["pos"]
    used = (g["pos"] > 0) & (neg > 0)
    gu = g[used]
    per_user = (gu["rank_pos"] - gu["pos"] * (gu["pos"] + 1) / 2) / (gu["pos"] * neg[used])
    rows = int(gu["n"].sum())
    value = float((per_user * gu["n"]).sum() / rows) if rows else None
    return {"gauc": value, "users_used": int(used.sum()), "users_skipped": int((~used).sum()), "rows_used": rows}


def _none_if_nan(v):
    return None if isinstance(v, float) and math.isnan(v) else v


def summary(y: np.ndarray, p: np.ndarray) -> dict:
    """JSON-safe metric dict (NaN becomes None): auc, logloss, rows, ctr, mean_pctr, ne,
    calibration_ratio, ece (10 quantile bins)."""
    y, p = check_inputs(y, p, "summary")
    out = {
        "auc": auc(y, p),
        "logloss": logloss(y, p),
        "rows": int(len(y)),
        "ctr": float(np.mean(y)) if len(y) else None,
        "mean_pctr": float(np.mean(p)) if len(p) else None,
        "ne": normalized_entropy(y, p),
        "calibration_ratio": calibration_ratio(y, p),
        "ece": expected_calibration_error(y, p),
    }
    return {k: _none_if_nan(v) for k, v in out.items()}


def sigmoid(logits: np.ndarray) -> np.ndarray:
    """Probabilities from logits, in float64 (what the metrics above take)."""
    return 1.0 / (1.0 + np.exp(-np.asarray(logits, dtype=np.float64)))


def row_logloss(y, p, eps: float = 1e-7) -> np.ndarray:
    """Each row's logloss of the predicted click probability `p` for the label `y`."""
    p = np.clip(np.asarray(p, dtype=np.float64), eps, 1 - eps)
    y = np.asarray(y, dtype=np.float64)
    return -(y * np.log(p) + (1 - y) * np.log1p(-p))


def paired_differences(y, champion, candidate) -> np.ndarray:
    """logloss(champion) - logloss(candidate) per row: positive where the candidate predicts the row better."""
    return row_logloss(y, champion) - row_logloss(y, candidate)


def check_result(check: dict) -> str:
    """How a check ({"value", "passed", ...}) reads in every table (the gate's, the report's, the model card's):
    PASS / FAIL, and where it has no value what it is: an optional check "not measured" (passing by the
    policy, not by a figure), a required one "FAIL (not measured)"."""
    if check.get("value") is None:
        return "not measured" if check.get("passed") else "FAIL (not measured)"
    return "PASS" if check.get("passed") else "FAIL"
