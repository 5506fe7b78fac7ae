"""Group fairness gaps of a CTR model across a user attribute (gender, age bucket, ...).

* demographic parity: the spread (max - min over groups) of the mean predicted CTR and, given a
  decision threshold, of the share of rows with p >= threshold.
* equalized odds: at a threshold, max(TPR spread, FPR spread) over groups.

Null attribute values form their own group, "<null>" (the token features.encode gives them too),
so rows without the attribute are judged rather than dropped. A real value spelled "<null>" would
merge with them. Groups under `min_rows` rows (and, for equalized odds, groups without a click or
without a non-click, whose TPR/FPR is undefined) are listed with a reason and left out of the gaps.
A gap needs at least two groups; otherwise it is None.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from pipelines.metrics import EvaluationInputError, check_inputs

NULL_GROUP = "<null>"
DEFAULT_MIN_ROWS = 30


def group_labels(groups, n: int, where: str) -> np.ndarray:
    """Group values as strings, nulls as NULL_GROUP; length-checked against n rows."""
    g = pd.Series(groups).astype("string").fillna(NULL_GROUP).to_numpy(dtype=object)
    if len(g) != n:
        raise EvaluationInputError(f"{where}: {len(g)} group values for {n} rows")
    return g


def _check_threshold(threshold, where: str) -> None:
    if threshold is not None and not 0.0 <= float(threshold) <= 1.0:
        raise EvaluationInputError(f"{where}: threshold must be in [0, 1], got {threshold}")


def _spread(per_group: dict, key: str) -> float | None:
    vals = [v[key] for v in per_group.values() if v["included"] and v[key] is not None]
    return float(max(vals) - min(vals)) if len(vals) >= 2 else None


def _argspread(per_group: dict, key: str) -> list[str] | None:
    """[lowest group, highest group] of `key`, which is what a reader acts on."""
    items = [(v[key], g) for g, v in per_group.items() if v["included"] and v[key] is not None]
    if len(items) < 2:
        return None
    return [min(items)[1], max(items)[1]]


def demographic_parity_difference(p, groups, threshold: float | None = None, min_rows: int = DEFAULT_MIN_ROWS) -> dict:
    """{"groups": {g: {"rows", "mean_pctr", "positive_rate", "included", "reason"}},
    "mean_pctr_gap", "positive_rate_gap", "extremes": {"mean_pctr": [low, high], "positive_rate": ...},
    "threshold", "min_rows"}. positive_rate and its gap are None without a threshold."""
    p = np.asarray(p, dtype=np.float64).ravel()
    _, p = check_inputs(np.zeros(len(p)), p, "demographic_parity_difference")
    _check_threshold(threshold, "demographic_parity_difference")
    g = group_labels(groups, len(p), "demographic_parity_difference")
    per_group = {}
    for name in sorted(set(g)):
        pg = p[g == name]
        ok = len(pg) >= min_rows
        per_group[name] = {
            "rows": int(len(pg)),
            "mean_pctr": float(pg.mean()),
            "positive_rate": float((pg >= threshold).mean()) if threshold is not None else None,
            "included": ok,
            "reason": None if ok else f"fewer than {min_rows} rows",
        }
    return {
        "groups": per_group,
        "mean_pctr_gap": _spread(per_group, "mean_pctr"),
        "positive_rate_gap": _spread(per_group, "positive_rate"),
        "extremes": {
            "mean_pctr": _argspread(per_group, "mean_pctr"),
            "positive_rate": _argspread(per_group, "positive_rate"),
        },
        "threshold": None if threshold is None else float(threshold),
        "min_rows": int(min_rows),
    }


def _rates(yg: np.ndarray, decide: np.ndarray, min_rows: int) -> dict:
    pos, neg = int(yg.sum()), int(len(yg) - yg.sum())
    reason = (
        f"fewer than {min_rows} rows"
        if len(yg) < min_rows
        else "no positive rows"
        if pos == 0
        else "no negative rows"
        if neg == 0
        else None
    )
    return {
        "rows": int(len(yg)),
        "positives": pos,
        "negatives": neg,
        "tpr": float(decide[yg == 1].mean()) if pos else None,
        "fpr": float(decide[yg == 0].mean()) if neg else None,
        "included": reason is None,
        "reason": reason,
    }


def equalized_odds_difference(y, p, groups, threshold: float, min_rows: int = DEFAULT_MIN_ROWS) -> dict:
    """{"groups": {g: {"rows", "positives", "negatives", "tpr", "fpr", "included", "reason"}},
    "tpr_gap", "fpr_gap", "equalized_odds_difference" (max of the two), "extremes", "threshold",
    "min_rows"}. A decision is p >= threshold."""
    if threshold is None:
        raise EvaluationInputError("equalized_odds_difference: a decision threshold is required")
    y, p = check_inputs(y, p, "equalized_odds_difference")
    _check_threshold(threshold, "equalized_odds_difference")
    g = group_labels(groups, len(y), "equalized_odds_difference")
    decide = (p >= threshold).astype(np.float64)
    per_group = {name: _rates(y[g == name], decide[g == name], min_rows) for name in sorted(set(g))}
    tpr_gap, fpr_gap = _spread(per_group, "tpr"), _spread(per_group, "fpr")
    gaps = [v for v in (tpr_gap, fpr_gap) if v is not None]
    return {
        "groups": per_group,
        "tpr_gap": tpr_gap,
        "fpr_gap": fpr_gap,
        "equalized_odds_difference": max(gaps) if gaps else None,
        "extremes": {"tpr": _argspread(per_group, "tpr"), "fpr": _argspread(per_group, "fpr")},
        "threshold": float(threshold),
        "min_rows": int(min_rows),
    }
