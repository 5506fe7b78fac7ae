"""AUC / logloss / NE / calibration / GAUC against hand-computed cases or sklearn, and the JSON-safe summary."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from sklearn.calibration import calibration_curve
from sklearn.metrics import roc_auc_score

from pipelines.errors import PipelineError
from pipelines.metrics import (
    EvaluationInputError,
    auc,
    calibration_ratio,
    check_inputs,
    expected_calibration_error,
    gauc,
    logloss,
    normalized_entropy,
    reliability_curve,
    summary,
)


def test_auc_hand_computed():
    # positives {0.35, 0.8}, negatives {0.1, 0.4}: of the 4 (pos, neg) pairs, 3 are ranked right -> 0.75
    assert auc(np.array([0, 0, 1, 1]), np.array([0.1, 0.4, 0.35, 0.8])) == pytest.approx(0.75)
    assert auc([0, 1], [0.2, 0.9]) == 1.0
    assert auc([0, 1], [0.9, 0.2]) == 0.0
    # a tie between a positive and a negative counts one half: pairs (0.5>0.1)=1, (0.5=0.5)=0.5 -> 0.75
    assert auc([0, 0, 1], [0.1, 0.5, 0.5]) == pytest.approx(0.75)
    # only the ranking matters
    y, p = np.array([1, 0, 1, 0, 0]), np.array([0.9, 0.3, 0.4, 0.5, 0.1])
    assert auc(y, p) == pytest.approx(auc(y, p**3)) == pytest.approx(5 / 6)


def test_logloss_hand_computed():
    y = np.array([1, 0, 1, 0])
    p = np.array([0.9, 0.2, 0.6, 0.4])
    expected = -(math.log(0.9) + math.log(0.8) + math.log(0.6) + math.log(0.6)) / 4
    assert logloss(y, p) == pytest.approx(expected, rel=1e-12)
    assert logloss([1, 0], [0.5, 0.5]) == pytest.approx(math.log(2))


def test_logloss_clips_hard_zero_and_one():
    # a confident mistake is large but finite (clipped at 1e-7)
    v = logloss([1, 0], [0.0, 0.0])
    assert math.isfinite(v) and v == pytest.approx(-math.log(1e-7) / 2, rel=1e-6)
    assert logloss([1, 0], [1.0, 0.0]) == pytest.approx(-math.log(1 - 1e-7), abs=1e-9)


def test_logloss_works_with_a_single_class():
    assert logloss([1, 1], [0.5, 0.25]) == pytest.approx(-(math.log(0.5) + math.log(0.25)) / 2)
    assert logloss([0, 0, 0], [0.1, 0.1, 0.1]) == pytest.approx(-math.log(0.9))


def test_degenerate_inputs_give_nan():
    assert math.isnan(auc([1, 1, 1], [0.1, 0.5, 0.9]))
    assert math.isnan(auc([0, 0], [0.1, 0.5]))
    assert math.isnan(auc([], []))
    assert math.isnan(logloss([], []))


def test_summary_values_and_json_safety():
    y = np.array([0, 0, 1, 1], dtype=np.float32)
    p = np.array([0.1, 0.4, 0.35, 0.8], dtype=np.float32)
    s = summary(y, p)
    assert s["auc"] == pytest.approx(0.75)
    assert s["logloss"] == pytest.approx(logloss(y, p))
    assert s["rows"] == 4 and isinstance(s["rows"], int)
    assert s["ctr"] == pytest.approx(0.5) and s["mean_pctr"] == pytest.approx(0.4125)
    assert json.loads(json.dumps(s, allow_nan=False)) == s


def test_summary_single_class_gives_none_auc():
    s = summary(np.array([0, 0, 0]), np.array([0.2, 0.3, 0.1]))
    assert s["auc"] is None
    assert s["logloss"] == pytest.approx(logloss([0, 0, 0], [0.2, 0.3, 0.1]))
    assert s["ctr"] == 0.0 and s["rows"] == 3
    json.dumps(s, allow_nan=False)  # no NaN leaks into the report


def test_summary_of_nothing_is_all_none_but_rows():
    s = summary(np.array([]), np.array([]))
    assert s == {
        "auc": None,
        "logloss": None,
        "rows": 0,
        "ctr": None,
        "mean_pctr": None,
        "ne": None,
        "calibration_ratio": None,
        "ece": None,
    }


def test_summary_new_keys_hand_computed():
    y, p = np.array([0, 0, 1, 1]), np.array([0.1, 0.4, 0.35, 0.8])
    s = summary(y, p)
    assert s["ne"] == pytest.approx(logloss(y, p) / math.log(2))  # background CTR 0.5: entropy ln 2
    assert s["calibration_ratio"] == pytest.approx(0.4125 / 0.5)
    # 4 distinct scores, 10 quantile bins: every row sits in its own bin, so ECE = mean |y - p|
    assert s["ece"] == pytest.approx((0.1 + 0.4 + 0.65 + 0.2) / 4)
    s1 = summary([0, 0, 0], [0.2, 0.3, 0.1])
    assert s1["ne"] is None and s1["calibration_ratio"] is None and s1["ece"] == pytest.approx(0.2)


# ----------------------------------------------------------------------------- NE, calibration ratio
def test_normalized_entropy():
    y = np.array([1, 0, 0, 0])
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert normalized_entropy(y, [0.5, 0.25, 0.25, 0.25]) == pytest.approx(
        -(math.log(0.5) + 3 * math.log(0.75)) / 4 / h
    )
    # predicting the background CTR everywhere is NE 1 by definition
    assert normalized_entropy(y, [0.25] * 4) == pytest.approx(1.0)
    assert normalized_entropy(y, [0.9, 0.1, 0.1, 0.1]) < 1.0
    for yy in ([1, 1], [0, 0], []):
        assert math.isnan(normalized_entropy(yy, [0.5] * len(yy)))


def test_calibration_ratio():
    assert calibration_ratio([1, 0, 0, 0], [0.5, 0.5, 0.25, 0.25]) == pytest.approx(1.5)
    assert calibration_ratio([1, 1, 0, 0], [0.5, 0.5, 0.5, 0.5]) == pytest.approx(1.0)
    assert math.isnan(calibration_ratio([0, 0], [0.1, 0.2]))
    assert math.isnan(calibration_ratio([], []))


# ----------------------------------------------------------------------------- reliability, ECE
def test_reliability_curve_uniform_hand_computed():
    c = reliability_curve([0, 0, 1, 1, 1], [0.1, 0.15, 0.6, 0.7, 0.95], bins=2, strategy="uniform")
    assert c["strategy"] == "uniform" and c["bins"] == 2 and c["count"] == [2, 3]
    assert c["mean_predicted"] == pytest.approx([0.125, 0.75]) and c["observed_rate"] == [0.0, 1.0]
    # (2 * |0 - 0.125| + 3 * |1 - 0.75|) / 5
    assert expected_calibration_error([0, 0, 1, 1, 1], [0.1, 0.15, 0.6, 0.7, 0.95], 2, "uniform") == pytest.approx(0.2)
    # empty bins are dropped: everything below 0.1 lands in the first of 10 uniform bins
    c = reliability_curve([0, 1, 0], [0.01, 0.02, 0.05], bins=10, strategy="uniform")
    assert c["count"] == [3] and c["observed_rate"] == pytest.approx([1 / 3])


def test_reliability_curve_quantile_hand_computed():
    # median 0.25 splits {0.1, 0.2} | {0.3, 0.4}
    c = reliability_curve([0, 1, 0, 1], [0.1, 0.2, 0.3, 0.4], bins=2)
    assert c["strategy"] == "quantile" and c["count"] == [2, 2]
    assert c["mean_predicted"] == pytest.approx([0.15, 0.35]) and c["observed_rate"] == [0.5, 0.5]
    assert expected_calibration_error([0, 1, 0, 1], [0.1, 0.2, 0.3, 0.4], bins=2) == pytest.approx(0.25)


@pytest.mark.parametrize("strategy", ["quantile", "uniform"])
def test_reliability_curve_matches_sklearn(strategy):
    rng = np.random.default_rng(3)
    p = np.round(rng.beta(1, 30, 5000), 3)  # low CTR with ties, where quantile edges can merge
    y = (rng.random(5000) < p * 1.3).astype(int)
    c = reliability_curve(y, p, bins=10, strategy=strategy)
    prob_true, prob_pred = calibration_curve(y, p, n_bins=10, strategy=strategy)
    assert c["observed_rate"] == pytest.approx(list(prob_true), abs=1e-12)
    assert c["mean_predicted"] == pytest.approx(list(prob_pred), abs=1e-12)
    assert sum(c["count"]) == 5000
    ece = sum(n * abs(o - m) for n, o, m in zip(c["count"], prob_true, prob_pred)) / 5000
    assert expected_calibration_error(y, p, 10, strategy) == pytest.approx(ece)
    assert json.loads(json.dumps(c, allow_nan=False)) == c


def test_reliability_curve_bad_arguments():
    with pytest.raises(EvaluationInputError, match="strategy"):
        reliability_curve([0, 1], [0.1, 0.2], strategy="kmeans")
    with pytest.raises(EvaluationInputError, match="bins"):
        reliability_curve([0, 1], [0.1, 0.2], bins=0)
    assert reliability_curve([], [])["count"] == [] and math.isnan(expected_calibration_error([], []))


# ----------------------------------------------------------------------------- GAUC
def test_gauc_hand_computed():
    y = [1, 0, 0, 1, 0, 0, 0]
    p = [0.9, 0.5, 0.95, 0.6, 0.2, 0.3, 0.4]
    users = ["a", "a", "a", "b", "b", "c", "c"]
    # a: the click beats 0.5, loses to 0.95 -> 0.5 (3 rows); b: 1.0 (2 rows); c: no click, skipped
    assert gauc(y, p, users) == {
        "gauc": pytest.approx((3 * 0.5 + 2 * 1.0) / 5),
        "users_used": 2,
        "users_skipped": 1,
        "rows_used": 5,
    }


def test_gauc_ties_nulls_and_degenerate():
    # a tie inside a user counts 1/2; null user ids form one user
    g = gauc([1, 0, 1, 0], [0.3, 0.3, 0.8, 0.1], pd.array(["u", "u", None, None], dtype="string"))
    assert g["gauc"] == pytest.approx((2 * 0.5 + 2 * 1.0) / 4) and g["users_used"] == 2
    assert gauc([0, 0], [0.1, 0.2], ["a", "b"]) == {"gauc": None, "users_used": 0, "users_skipped": 2, "rows_used": 0}
    assert gauc([], [], []) == {"gauc": None, "users_used": 0, "users_skipped": 0, "rows_used": 0}
    with pytest.raises(EvaluationInputError, match="user ids"):
        gauc([0, 1], [0.1, 0.2], ["a"])


def test_gauc_matches_a_per_user_sklearn_loop():
    rng = np.random.default_rng(11)
    n = 3000
    users = rng.integers(0, 150, n).astype(str)
    y = (rng.random(n) < 0.2).astype(int)
    p = np.round(np.clip(0.2 + 0.1 * y + rng.normal(0, 0.15, n), 0, 1), 2)  # rounded: ties within users
    num = rows = used = 0
    for u in np.unique(users):
        m = users == u
        if 0 < y[m].sum() < m.sum():
            num += m.sum() * roc_auc_score(y[m], p[m])
            rows += m.sum()
            used += 1
    g = gauc(y, p, users)
    assert g["gauc"] == pytest.approx(num / rows, abs=1e-12)
    assert g["users_used"] == used and g["rows_used"] == rows and g["users_skipped"] == len(np.unique(users)) - used
    assert all(type(v) in (int, float) for v in g.values())


# ----------------------------------------------------------------------------- input checks
@pytest.mark.parametrize(
    "y, p, match",
    [
        ([0, 1, 1], [0.1, 0.2], "3 labels but 2 scores"),
        ([0, 1], [0.1, float("nan")], "NaN"),
        ([0, 2], [0.1, 0.2], "0/1"),
        ([0, 1], [0.1, 1.5], r"\[0, 1\]"),
    ],
)
def test_bad_inputs_raise_a_typed_error(y, p, match):
    for f in (check_inputs, summary, normalized_entropy, calibration_ratio, reliability_curve):
        with pytest.raises(EvaluationInputError, match=match):
            f(y, p)
    assert issubclass(EvaluationInputError, PipelineError) and issubclass(EvaluationInputError, ValueError)
