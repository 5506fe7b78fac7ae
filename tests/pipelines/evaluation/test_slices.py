"""Per-slot and cold/warm slices, the one-model evaluation and the candidate-vs-champion comparison."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from pipelines.evaluation.delong import delong_test
from pipelines.evaluation.fairness import demographic_parity_difference, equalized_odds_difference
from pipelines.metrics import EvaluationInputError, gauc, reliability_curve, summary
from pipelines.evaluation.slices import cold_warm, compare_predictions, evaluate_predictions, slice_metrics


def click_rows(n: int = 1200, seed: int = 0) -> tuple[pd.DataFrame, np.ndarray, np.ndarray, np.ndarray]:
    """Contract-shaped rows, labels and two models' scores (the first one better)."""
    rng = np.random.default_rng(seed)
    s = lambda values: pd.array(values, dtype="string")  # noqa: E731
    frame = pd.DataFrame(
        {
            "user_id": s([f"u{i}" for i in rng.integers(0, 80, n)]),
            "item_id": s([f"i{i}" for i in rng.integers(0, 50, n)]),
            "slot": s(rng.choice(["morning", "afternoon", "night"], n, p=[0.5, 0.45, 0.05])),
            "gender": s(rng.choice(np.array(["F", "M", None], dtype=object), n)),
            "age_bucket": s(rng.choice(np.array(["18-24", "25-34", "35+", None], dtype=object), n)),
            "occupation": s(rng.choice(["a", "b"], n)),
            "category": s(rng.choice(["x", "y"], n)),
            "hour": rng.integers(0, 24, n).astype(np.int8),
            "weekday": rng.integers(0, 7, n).astype(np.int8),
        }
    )
    y = (rng.random(n) < 0.1).astype(np.int8)
    frame["label"] = y
    good = np.clip(0.1 + 0.15 * y + rng.normal(0, 0.05, n), 0.001, 0.999)
    weak = np.clip(0.1 + 0.03 * y + rng.normal(0, 0.05, n), 0.001, 0.999)
    return frame, y.astype(float), good, weak


def test_slice_metrics_are_the_summaries_of_the_slices():
    frame, y, p, _ = click_rows()
    r = slice_metrics(frame, y, p, "slot", min_rows=100)
    assert list(r) == ["afternoon", "morning", "night"]
    for slot in ("afternoon", "morning"):
        m = (frame["slot"] == slot).to_numpy()
        assert r[slot] == {**summary(y[m], p[m]), "skipped": None}
    night = (frame["slot"] == "night").to_numpy()
    assert night.sum() < 100  # ~5 % of 1200 rows
    assert r["night"]["skipped"] == "fewer than 100 rows" and r["night"]["auc"] is None
    assert r["night"]["rows"] == int(night.sum()) and r["night"]["ctr"] == pytest.approx(y[night].mean())
    assert json.loads(json.dumps(r, allow_nan=False)) == r


def test_slice_metrics_null_values_and_errors():
    frame = pd.DataFrame({"slot": pd.array(["a", None, "a", None], dtype="string")})
    r = slice_metrics(frame, [1, 0, 0, 1], [0.9, 0.2, 0.1, 0.4], "slot", min_rows=1)
    assert r["a"]["auc"] == 1.0 and r["<null>"]["auc"] == 1.0 and r["<null>"]["rows"] == 2
    with pytest.raises(EvaluationInputError, match="no column 'hourly'"):
        slice_metrics(frame, [1, 0, 0, 1], [0.9, 0.2, 0.1, 0.4], "hourly")
    with pytest.raises(EvaluationInputError, match="4 rows for 3 labels"):
        slice_metrics(frame, [1, 0, 0], [0.9, 0.2, 0.1], "slot")


def test_cold_warm():
    y, p = np.array([1, 0, 1, 0, 0, 1]), np.array([0.9, 0.1, 0.2, 0.8, 0.3, 0.7])
    cold = np.array([True, True, False, False, False, False])
    r = cold_warm(y, p, cold, min_rows=2)
    assert r["cold"]["auc"] == 1.0 and r["cold"]["rows"] == 2
    # warm: clicks {0.2, 0.7} vs non-clicks {0.8, 0.3}: only 0.7 > 0.3 of the 4 pairs
    assert r["warm"]["auc"] == 0.25 and r["cold_fraction"] == pytest.approx(1 / 3)
    assert cold_warm(y, p, cold, min_rows=3)["cold"]["skipped"] == "fewer than 3 rows"
    with pytest.raises(EvaluationInputError, match="boolean"):
        cold_warm(y, p, cold.astype(int))
    with pytest.raises(EvaluationInputError, match="5 values for 6 rows"):
        cold_warm(y, p, cold[:5])


def test_evaluate_predictions_shape_and_values():
    frame, y, p, _ = click_rows()
    cold = (frame["user_id"].str.len() == 2).to_numpy()  # u0-u9: "cold" users
    r = evaluate_predictions(frame, y, p, cold_mask=cold)
    assert set(r) == {"overall", "gauc", "reliability", "slots", "cold_warm", "fairness", "threshold", "threshold_rule"}
    assert r["overall"] == summary(y, p) and r["gauc"] == gauc(y, p, frame["user_id"])
    assert r["reliability"] == reliability_curve(y, p)
    assert r["threshold"] == pytest.approx(y.mean()) and r["threshold_rule"] == "base_rate"
    assert r["cold_warm"] == cold_warm(y, p, cold)
    assert set(r["fairness"]) == {"gender", "age_bucket"}
    t = y.mean()
    assert r["fairness"]["gender"]["demographic_parity"] == demographic_parity_difference(p, frame["gender"], t)
    assert r["fairness"]["age_bucket"]["equalized_odds"] == equalized_odds_difference(y, p, frame["age_bucket"], t)
    assert "<null>" in r["fairness"]["gender"]["demographic_parity"]["groups"]
    assert json.loads(json.dumps(r, allow_nan=False)) == r

    given = evaluate_predictions(frame, y, p, threshold=0.5, fairness_columns=("occupation",), slot_col="category")
    assert given["threshold"] == 0.5 and given["threshold_rule"] == "given" and given["cold_warm"] is None
    assert set(given["fairness"]) == {"occupation"} and set(given["slots"]) == {"x", "y"}


def test_evaluate_predictions_bad_inputs():
    frame, y, p, _ = click_rows(200)
    with pytest.raises(EvaluationInputError, match="no column 'race'"):
        evaluate_predictions(frame, y, p, fairness_columns=("race",))
    with pytest.raises(EvaluationInputError, match="200 rows for 199 labels"):
        evaluate_predictions(frame, y[:-1], p[:-1])
    with pytest.raises(EvaluationInputError, match="threshold must be in"):
        evaluate_predictions(frame, y, p, threshold=2.0)


def test_compare_predictions_with_and_without_champion():
    frame, y, good, weak = click_rows()
    r = compare_predictions(frame, y, good, weak)
    assert set(r) == {"candidate", "champion", "delong", "delong_skipped", "threshold", "threshold_rule"}
    assert r["candidate"] == evaluate_predictions(frame, y, good)
    assert r["champion"] == evaluate_predictions(frame, y, weak)
    assert r["delong"] == delong_test(y, good, weak) and r["delong_skipped"] is None
    assert r["delong"]["diff"] > 0 and r["delong"]["p_value"] < 1e-3
    assert r["threshold"] == pytest.approx(y.mean()) and r["threshold_rule"] == "base_rate"
    assert json.loads(json.dumps(r, allow_nan=False)) == r

    alone = compare_predictions(frame, y, good, None, threshold=0.2)
    assert alone["champion"] is None and alone["delong"] is None and alone["delong_skipped"] == "no champion"
    assert alone["threshold"] == 0.2 and alone["candidate"]["threshold_rule"] == "given"


def test_compare_on_a_holdout_without_clicks_reports_instead_of_failing():
    frame, _, good, weak = click_rows(300)
    y = np.zeros(300)
    r = compare_predictions(frame, y, good, weak, threshold=0.5)
    assert r["delong"] is None and "0 positive" in r["delong_skipped"]
    assert r["candidate"]["overall"]["auc"] is None and r["champion"]["overall"]["rows"] == 300
    with pytest.raises(EvaluationInputError, match="base-rate threshold"):
        compare_predictions(frame.iloc[:0], np.array([]), np.array([]), None)
