"""AUC / logloss against hand-computed cases, and the JSON-safe summary."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from pipelines.evaluation.metrics import auc, logloss, summary


def test_auc_hand_computed():
    # positives {0.35, 0.8}, negatives {0.1, 0.4}: of the 4 (pos, neg) pairs, 3 are ranked right -> 0.75
    assert auc(np.array([0, 0, 1, 1]), np.array([0.1, 0.4, 0.35, 0.8])) == pytest.approx(0.75)
    assert auc([0, 1], [0.2, 0.9]) == 1.0
    assert auc([0, 1], [0.9, 0.2]) == 0.0
    # a tie between a positive and a negative counts one half: pairs (0.5>0.1)=1, (0.5=0.5)=0.5 -> 0.75
    assert auc([0, 0, 1], [0.1, 0.5, 0.5]) == pytest.approx(0.75)
    # only the ranking matters
    y, p = np.array([1, 0, 1, 0, 0]), np.array([0.9, 0.3, 0.4, 0.5, 0.1])
    assert auc(y, p) == pytest.approx(auc(y, p ** 3)) == pytest.approx(5 / 6)


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
    assert s == {"auc": None, "logloss": None, "rows": 0, "ctr": None, "mean_pctr": None}
