"""DeLong's test (fast midrank form) against an O(n^2) pair table, a hand-derived case and sklearn."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from pipelines.evaluation.delong import auc_ci, covariance, delong_test, structural_components
from pipelines.metrics import EvaluationInputError


def brute_components(y: np.ndarray, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """DeLong (1988) placements straight from the m x n table psi(x_i, y_j) = 1 / 0.5 / 0."""
    x, z = p[y == 1], p[y == 0]
    psi = (x[:, None] > z[None, :]) + 0.5 * (x[:, None] == z[None, :])
    return psi.mean(axis=1), psi.mean(axis=0)


def sample_var(v: np.ndarray, w: np.ndarray) -> float:
    return float(((v - v.mean()) * (w - w.mean())).sum() / (len(v) - 1))


def test_components_match_the_pair_table_with_ties():
    rng = np.random.default_rng(5)
    y = (rng.random(400) < 0.3).astype(int)
    p_a = rng.integers(0, 12, 400) / 12  # heavy ties, within and across classes
    p_b = np.round(0.3 * y + rng.random(400), 1)
    aucs, v10, v01 = structural_components(y, [p_a, p_b])
    for k, p in enumerate((p_a, p_b)):
        b10, b01 = brute_components(y, p)
        np.testing.assert_allclose(v10[k], b10, atol=1e-12)
        np.testing.assert_allclose(v01[k], b01, atol=1e-12)
        assert aucs[k] == pytest.approx(roc_auc_score(y, p), abs=1e-12)
    b10a, b01a = brute_components(y, p_a)
    b10b, b01b = brute_components(y, p_b)
    m, n = int(y.sum()), int(len(y) - y.sum())
    cov_ab = sample_var(b10a, b10b) / m + sample_var(b01a, b01b) / n
    var_a = sample_var(b10a, b10a) / m + sample_var(b01a, b01a) / n
    var_b = sample_var(b10b, b10b) / m + sample_var(b01b, b01b) / n
    np.testing.assert_allclose(covariance(v10, v01), [[var_a, cov_ab], [cov_ab, var_b]], atol=1e-14)
    r = delong_test(y, p_a, p_b)
    assert r["se"] == pytest.approx(math.sqrt(var_a + var_b - 2 * cov_ab), rel=1e-10)
    assert r["p_value"] == pytest.approx(math.erfc(abs(r["diff"] / r["se"]) / math.sqrt(2)), rel=1e-10)


def test_hand_derived_example():
    # positives are rows 0, 1; negatives rows 2, 3.
    # model a: X = {0.9, 0.4}, Y = {0.5, 0.1}
    #   V10 = [ (1+1)/2, (0+1)/2 ] = [1, 0.5];  V01 = [ (1+0)/2, (1+1)/2 ] = [0.5, 1];  AUC 0.75
    # model b: X = {0.6, 0.3}, Y = {0.3, 0.8}   (0.3 vs 0.3 is a tie: 1/2)
    #   V10 = [ (1+0)/2, (0.5+0)/2 ] = [0.5, 0.25];  V01 = [ (1+0.5)/2, 0 ] = [0.75, 0];  AUC 0.375
    # sample covariances (ddof 1, two points: sum of products of deviations):
    #   S10: var_a 0.125, var_b 0.03125, cov 0.25*0.125*2 = 0.0625
    #   S01: var_a 0.125, var_b 0.28125, cov (-0.25*0.375)*2 = -0.1875
    # S = S10/2 + S01/2: var_a 0.125, var_b 0.15625, cov -0.0625
    # var(diff) = 0.125 + 0.15625 + 2*0.0625 = 0.40625
    y = [1, 1, 0, 0]
    r = delong_test(y, [0.9, 0.4, 0.5, 0.1], [0.6, 0.3, 0.3, 0.8])
    assert (r["auc_a"], r["auc_b"]) == (0.75, 0.375) and r["diff"] == 0.375
    assert (r["var_a"], r["var_b"], r["cov"]) == pytest.approx((0.125, 0.15625, -0.0625))
    se = math.sqrt(0.40625)
    assert r["se"] == pytest.approx(se)
    assert r["z"] == pytest.approx(0.375 / se)
    assert r["p_value"] == pytest.approx(math.erfc(0.375 / se / math.sqrt(2)))  # ~0.556
    assert r["ci95"] == pytest.approx([0.375 - 1.959964 * se, 0.375 + 1.959964 * se], rel=1e-6)
    assert (r["n_pos"], r["n_neg"]) == (2, 2)
    assert json.loads(json.dumps(r, allow_nan=False)) == r

    ci = auc_ci(y, [0.9, 0.4, 0.5, 0.1])
    assert ci["auc"] == 0.75 and ci["se"] == pytest.approx(math.sqrt(0.125))
    assert ci["ci"] == pytest.approx([0.75 - 1.959964 * math.sqrt(0.125), 1.0], rel=1e-6)  # clipped at 1


def test_identical_predictions():
    rng = np.random.default_rng(1)
    y = (rng.random(300) < 0.4).astype(int)
    p = np.round(rng.random(300), 2)
    r = delong_test(y, p, p.copy())
    assert r["diff"] == 0.0 and r["se"] == 0.0 and r["z"] == 0.0 and r["p_value"] == 1.0
    assert r["ci95"] == [0.0, 0.0] and r["var_a"] > 0


def test_zero_variance_with_a_difference():
    # a ranks perfectly, b perfectly backwards: both AUCs have zero variance, the difference is certain
    y = [0, 0, 1, 1]
    r = delong_test(y, [0.1, 0.2, 0.8, 0.9], [0.9, 0.8, 0.2, 0.1])
    assert (r["auc_a"], r["auc_b"], r["diff"], r["se"]) == (1.0, 0.0, 1.0, 0.0)
    assert r["z"] is None and r["p_value"] == 0.0
    json.dumps(r, allow_nan=False)


def test_clearly_better_model_is_significant_and_antisymmetric():
    rng = np.random.default_rng(7)
    y = (rng.random(2000) < 0.3).astype(int)
    good = 1 / (1 + np.exp(-(2 * y - 1 + rng.normal(0, 1.5, 2000))))
    weak = 1 / (1 + np.exp(-(0.3 * (2 * y - 1) + rng.normal(0, 1.5, 2000))))
    r = delong_test(y, good, weak)
    assert r["auc_a"] == pytest.approx(roc_auc_score(y, good)) and r["auc_b"] == pytest.approx(roc_auc_score(y, weak))
    assert r["diff"] > 0.1 and r["p_value"] < 1e-3 and r["ci95"][0] > 0
    back = delong_test(y, weak, good)
    assert back["diff"] == pytest.approx(-r["diff"]) and back["se"] == pytest.approx(r["se"])
    assert back["p_value"] == pytest.approx(r["p_value"])
    # and two noisy copies of the same signal are not told apart
    same = delong_test(y, good, np.clip(good + rng.normal(0, 1e-3, 2000), 0, 1))
    assert same["p_value"] > 0.05


@pytest.mark.parametrize(
    "y, a, b, match",
    [
        ([1, 1, 1, 1], [0.1, 0.2, 0.3, 0.4], [0.1, 0.2, 0.3, 0.4], "0 negative"),
        ([1, 0, 0, 0], [0.1, 0.2, 0.3, 0.4], [0.1, 0.2, 0.3, 0.4], "1 positive"),
        ([1, 1, 0, 0], [0.1, 0.2, 0.3], [0.1, 0.2, 0.3, 0.4], "score vector 0 has 3 values for 4 labels"),
        ([1, 1, 0, 0], [0.1, 0.2, 0.3, 0.4], [0.1, float("nan"), 0.3, 0.4], "score vector 1 has 1 NaN"),
        ([1, 2, 0, 0], [0.1, 0.2, 0.3, 0.4], [0.1, 0.2, 0.3, 0.4], "0/1"),
    ],
)
def test_degenerate_inputs_raise(y, a, b, match):
    with pytest.raises(EvaluationInputError, match=match):
        delong_test(y, a, b)
    with pytest.raises(ValueError):  # callers may catch the builtin
        delong_test(y, a, b)
