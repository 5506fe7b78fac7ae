"""One model's full evaluation on holdout rows (overall, GAUC, per slot, cold/warm, fairness) and
the candidate-vs-champion comparison with DeLong's test. Pure: arrays and a frame in, JSON-safe
dicts out; scoring and logging stay with the caller (pipelines.evaluation.compare).

The decision threshold (fairness rates) defaults to the observed CTR of the rows: a model
calibrated on average then flags about as many rows as there are clicks. The result says which
rule set it ("threshold_rule": "base_rate" or "given").
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from pipelines.evaluation.delong import delong_test
from pipelines.evaluation.fairness import (
    DEFAULT_MIN_ROWS,
    NULL_GROUP,
    demographic_parity_difference,
    equalized_odds_difference,
)
from pipelines.metrics import EvaluationInputError, check_inputs, gauc, reliability_curve, summary

DEFAULT_SLICE_MIN_ROWS = 100  # below this a slice's AUC is mostly noise: reported as skipped
_METRIC_KEYS = ("auc", "logloss", "ne", "calibration_ratio", "ece")


def _slice_summary(y: np.ndarray, p: np.ndarray, min_rows: int) -> dict:
    """summary() plus "skipped"; a slice under min_rows keeps rows/ctr/mean_pctr, metrics None."""
    s = summary(y, p)
    if len(y) < min_rows:
        s.update({k: None for k in _METRIC_KEYS})
        return {**s, "skipped": f"fewer than {min_rows} rows"}
    return {**s, "skipped": None}


def _column(frame: pd.DataFrame, name: str, where: str) -> pd.Series:
    if name not in frame.columns:
        raise EvaluationInputError(f"{where}: the frame has no column {name!r} (columns: {list(frame.columns)})")
    return frame[name]


def slice_metrics(frame: pd.DataFrame, y, p, by: str, min_rows: int = DEFAULT_SLICE_MIN_ROWS) -> dict:
    """{value of frame[by] (nulls as "<null>"): summary + "skipped"}, values in sorted order."""
    y, p = check_inputs(y, p, "slice_metrics")
    if len(frame) != len(y):
        raise EvaluationInputError(f"slice_metrics: the frame has {len(frame)} rows for {len(y)} labels")
    keys = _column(frame, by, "slice_metrics").astype("string").fillna(NULL_GROUP).to_numpy(dtype=object)
    return {k: _slice_summary(y[keys == k], p[keys == k], min_rows) for k in sorted(set(keys))}


def cold_warm(y, p, cold_mask, min_rows: int = DEFAULT_SLICE_MIN_ROWS) -> dict:
    """{"cold": summary, "warm": summary, "cold_fraction"}; cold_mask is True on cold-entity rows."""
    y, p = check_inputs(y, p, "cold_warm")
    mask = np.asarray(cold_mask)
    if mask.dtype != bool:
        raise EvaluationInputError(f"cold_warm: cold_mask must be boolean, got dtype {mask.dtype}")
    mask = mask.ravel()
    if len(mask) != len(y):
        raise EvaluationInputError(f"cold_warm: cold_mask has {len(mask)} values for {len(y)} rows")
    return {
        "cold": _slice_summary(y[mask], p[mask], min_rows),
        "warm": _slice_summary(y[~mask], p[~mask], min_rows),
        "cold_fraction": float(mask.mean()) if len(mask) else None,
    }


def resolve_threshold(y: np.ndarray, threshold: float | None) -> tuple[float, str]:
    if threshold is not None:
        if not 0.0 <= float(threshold) <= 1.0:
            raise EvaluationInputError(f"threshold must be in [0, 1], got {threshold}")
        return float(threshold), "given"
    if not len(y):
        raise EvaluationInputError("no rows: the base-rate threshold is undefined")
    return float(np.mean(y)), "base_rate"


def _fairness(frame: pd.DataFrame, y, p, columns, threshold: float, min_rows: int) -> dict:
    out = {}
    for col in columns:
        g = _column(frame, col, "fairness")
        out[col] = {
            "demographic_parity": demographic_parity_difference(p, g, threshold, min_rows),
            "equalized_odds": equalized_odds_difference(y, p, g, threshold, min_rows),
        }
    return out


def evaluate_predictions(
    frame: pd.DataFrame,
    y,
    p,
    *,
    cold_mask=None,
    threshold: float | None = None,
    fairness_columns: tuple[str, ...] = ("gender", "age_bucket"),
    user_col: str = "user_id",
    slot_col: str = "slot",
    slice_min_rows: int = DEFAULT_SLICE_MIN_ROWS,
    fairness_min_rows: int = DEFAULT_MIN_ROWS,
    bins: int = 10,
) -> dict:
    """Everything about one model's scores `p` on the rows of `frame` (labels `y`).

    {"overall": summary, "gauc": gauc(), "reliability": reliability_curve() (quantile bins),
     "slots": slice_metrics(by=slot_col), "cold_warm": cold_warm() or None,
     "fairness": {column: {"demographic_parity": ..., "equalized_odds": ...}},
     "threshold": float, "threshold_rule": "base_rate" | "given"}
    """
    y, p = check_inputs(y, p, "evaluate_predictions")
    if len(frame) != len(y):
        raise EvaluationInputError(f"evaluate_predictions: the frame has {len(frame)} rows for {len(y)} labels")
    t, rule = resolve_threshold(y, threshold)
    return {
        "overall": summary(y, p),
        "gauc": gauc(y, p, _column(frame, user_col, "evaluate_predictions")),
        "reliability": reliability_curve(y, p, bins),
        "slots": slice_metrics(frame, y, p, slot_col, slice_min_rows),
        "cold_warm": None if cold_mask is None else cold_warm(y, p, cold_mask, slice_min_rows),
        "fairness": _fairness(frame, y, p, fairness_columns, t, fairness_min_rows),
        "threshold": t,
        "threshold_rule": rule,
    }


def compare_predictions(frame: pd.DataFrame, y, p_candidate, p_champion=None, **kwargs) -> dict:
    """{"candidate": evaluate_predictions(...), "champion": ... or None, "delong": delong_test(
    y, candidate, champion) or None, "delong_skipped": reason or None, "threshold", "threshold_rule"}.

    Both models are judged at one threshold (resolved once from `threshold` or the base rate).
    DeLong's diff is candidate - champion. It is skipped, with the reason, when there is no
    champion or the rows cannot support it (fewer than 2 clicks or 2 non-clicks).
    """
    y_arr, _ = check_inputs(y, p_candidate, "compare_predictions")
    t, rule = resolve_threshold(y_arr, kwargs.pop("threshold", None))
    cand = evaluate_predictions(frame, y_arr, p_candidate, threshold=t, **kwargs)
    champ, test, skipped = None, None, "no champion"
    if p_champion is not None:
        champ = evaluate_predictions(frame, y_arr, p_champion, threshold=t, **kwargs)
        try:
            test, skipped = delong_test(y_arr, p_candidate, p_champion), None
        except EvaluationInputError as e:  # a holdout without both classes: report, don't fail the run
            skipped = str(e)
    for r in (cand, champ):
        if r is not None:
            r["threshold_rule"] = rule
    return {
        "candidate": cand,
        "champion": champ,
        "delong": test,
        "delong_skipped": skipped,
        "threshold": t,
        "threshold_rule": rule,
    }
