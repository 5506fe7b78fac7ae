"""Demographic parity and equalized odds on groups built so the answers are known by hand."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from pipelines.evaluation.fairness import demographic_parity_difference, equalized_odds_difference
from pipelines.metrics import EvaluationInputError


def test_demographic_parity_hand_computed():
    p = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
    g = ["A", "A", "A", "B", "B", "B"]
    r = demographic_parity_difference(p, g, threshold=0.25, min_rows=1)
    # mean pCTR A 0.2, B 0.5; share with p >= 0.25: A 1/3, B 3/3
    assert r["groups"]["A"]["mean_pctr"] == pytest.approx(0.2) and r["groups"]["B"]["mean_pctr"] == pytest.approx(0.5)
    assert r["groups"]["A"]["positive_rate"] == pytest.approx(1 / 3) and r["groups"]["B"]["positive_rate"] == 1.0
    assert r["mean_pctr_gap"] == pytest.approx(0.3) and r["positive_rate_gap"] == pytest.approx(2 / 3)
    assert r["extremes"] == {"mean_pctr": ["A", "B"], "positive_rate": ["A", "B"]}
    assert r["threshold"] == 0.25 and r["groups"]["A"]["rows"] == 3
    assert json.loads(json.dumps(r, allow_nan=False)) == r
    # threshold at a score: p >= threshold is a positive decision
    assert demographic_parity_difference(p, g, threshold=0.3, min_rows=1)["groups"]["A"][
        "positive_rate"
    ] == pytest.approx(1 / 3)


def test_demographic_parity_without_threshold_and_with_nulls():
    p = [0.1, 0.3, 0.2, 0.6, 0.9]
    g = pd.array(["F", "F", None, None, "M"], dtype="string")
    r = demographic_parity_difference(p, g, min_rows=2)
    assert set(r["groups"]) == {"F", "M", "<null>"}
    assert r["groups"]["<null>"]["mean_pctr"] == pytest.approx(0.4)
    assert r["groups"]["F"]["mean_pctr"] == pytest.approx(0.2)
    # M has 1 row < min_rows 2: listed, not counted
    assert r["groups"]["M"] == {
        "rows": 1,
        "mean_pctr": 0.9,
        "positive_rate": None,
        "included": False,
        "reason": "fewer than 2 rows",
    }
    assert r["mean_pctr_gap"] == pytest.approx(0.2) and r["positive_rate_gap"] is None
    assert r["extremes"]["positive_rate"] is None and r["threshold"] is None
    # one usable group: no gap
    assert demographic_parity_difference(p, g, min_rows=3)["mean_pctr_gap"] is None


def test_equalized_odds_hand_computed():
    y = [1, 1, 0, 0] + [1, 1, 0, 0] + [0, 0, 0, 0] + [1, 0]
    p = [0.9, 0.1, 0.2, 0.8] + [0.9, 0.8, 0.6, 0.2] + [0.1, 0.9, 0.2, 0.3] + [0.9, 0.1]
    g = ["A"] * 4 + ["B"] * 4 + ["C"] * 4 + ["D"] * 2
    r = equalized_odds_difference(y, p, g, threshold=0.5, min_rows=4)
    # A: TPR 1/2, FPR 1/2.  B: TPR 2/2, FPR 1/2.  C: no click.  D: 2 rows < 4
    assert (r["groups"]["A"]["tpr"], r["groups"]["A"]["fpr"]) == (0.5, 0.5)
    assert (r["groups"]["B"]["tpr"], r["groups"]["B"]["fpr"]) == (1.0, 0.5)
    assert r["groups"]["C"]["included"] is False and r["groups"]["C"]["reason"] == "no positive rows"
    assert r["groups"]["C"]["tpr"] is None and r["groups"]["C"]["fpr"] == 0.25
    assert r["groups"]["D"]["reason"] == "fewer than 4 rows"
    assert r["tpr_gap"] == 0.5 and r["fpr_gap"] == 0.0 and r["equalized_odds_difference"] == 0.5
    assert r["extremes"]["tpr"] == ["A", "B"]
    assert r["groups"]["B"]["positives"] == 2 and r["groups"]["B"]["negatives"] == 2
    assert json.loads(json.dumps(r, allow_nan=False)) == r
    # with min_rows 2, D joins (TPR 1, FPR 0): FPR gap 0.5 - 0 = 0.5, TPR gap 1 - 0.5
    r2 = equalized_odds_difference(y, p, g, threshold=0.5, min_rows=2)
    assert r2["fpr_gap"] == 0.5 and r2["tpr_gap"] == 0.5 and r2["groups"]["D"]["included"]


def test_equalized_odds_no_negatives_and_single_group():
    r = equalized_odds_difference([1, 1, 0, 1], [0.9, 0.2, 0.7, 0.8], ["x", "x", "x", "y"], 0.5, min_rows=1)
    assert r["groups"]["y"]["reason"] == "no negative rows"
    assert r["tpr_gap"] is None and r["fpr_gap"] is None and r["equalized_odds_difference"] is None
    assert r["groups"]["x"]["tpr"] == 0.5 and r["groups"]["x"]["fpr"] == 1.0


def test_fairness_is_independent_of_row_order():
    rng = np.random.default_rng(2)
    y = (rng.random(600) < 0.3).astype(int)
    p = rng.random(600)
    g = rng.choice(["a", "b", "c"], 600)
    perm = rng.permutation(600)
    r1 = equalized_odds_difference(y, p, g, 0.4)
    r2 = equalized_odds_difference(y[perm], p[perm], g[perm], 0.4)
    assert r1["equalized_odds_difference"] == pytest.approx(r2["equalized_odds_difference"])
    # and the per-group rates are what a mask computes
    m = (g == "b") & (y == 1)
    assert r1["groups"]["b"]["tpr"] == pytest.approx((p[m] >= 0.4).mean())


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: equalized_odds_difference([0, 1], [0.1, 0.9], ["a", "b"], None), "threshold is required"),
        (lambda: equalized_odds_difference([0, 1], [0.1, 0.9], ["a", "b"], 1.5), "threshold must be in"),
        (lambda: equalized_odds_difference([0, 1], [0.1, 0.9], ["a"], 0.5), "1 group values for 2 rows"),
        (lambda: demographic_parity_difference([0.1, float("nan")], ["a", "b"]), "NaN"),
        (lambda: demographic_parity_difference([0.1, 0.2], ["a", "b", "c"]), "3 group values for 2 rows"),
    ],
)
def test_bad_inputs(call, match):
    with pytest.raises(EvaluationInputError, match=match):
        call()
