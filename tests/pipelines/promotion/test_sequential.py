"""The prequential gate's decision core (`promotion.sequential`): evidence that adds up over the days a
candidate waits, and an interval that stays valid when it is looked at every day."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipelines.promotion.sequential import Evidence, decide, interval, paired_differences, radius

ALPHA = 0.05


# ----------------------------------------------------------------------------- evidence
def test_evidence_adds_up_over_days_in_any_order_and_survives_a_tag():
    rng = np.random.default_rng(1)
    days = [rng.normal(0.01, 0.2, n) for n in (120, 300, 45)]
    at_once = Evidence().add(np.concatenate(days))
    day_by_day = Evidence()
    for d in days:
        day_by_day = day_by_day.add(d)
    merged = Evidence().add(days[2]).merge(Evidence().add(days[0]).add(days[1]))
    for ev in (day_by_day, merged, Evidence.from_json(day_by_day.to_json())):
        assert ev.n == at_once.n == 465
        assert ev.mean == pytest.approx(at_once.mean) and ev.sd == pytest.approx(at_once.sd)
    assert at_once.mean == pytest.approx(np.concatenate(days).mean())
    assert at_once.sd == pytest.approx(np.concatenate(days).std(ddof=1))


def test_evidence_refuses_what_is_not_a_row_difference():
    with pytest.raises(ValueError, match="finite"):
        Evidence().add([0.1, float("nan")])
    assert Evidence().mean is None and Evidence().add([0.3]).sd is None


def test_a_row_the_candidate_predicts_better_is_positive_evidence():
    y = np.array([1, 0])
    d = paired_differences(y, champion=[0.6, 0.4], candidate=[0.8, 0.2])
    assert (d > 0).all() and d[0] == pytest.approx(math.log(0.8 / 0.6))


# ----------------------------------------------------------------------------- the interval
def test_the_interval_is_wider_than_a_fixed_sample_one_and_closes_as_rows_come():
    fixed = lambda n: 1.96 / math.sqrt(n)  # noqa: E731  a 95% interval, valid at one pre-set n only
    widths = [radius(n, 1.0, ALPHA, planned_rows=2_000) for n in (100, 1_000, 2_000, 10_000)]
    assert all(w > fixed(n) for w, n in zip(widths, (100, 1_000, 2_000, 10_000)))
    assert widths == sorted(widths, reverse=True)
    # at the planned rows it is 1.55 times the fixed one (3.04 / 1.96 standard errors): the price of looking daily
    assert widths[2] == pytest.approx(1.55 * fixed(2_000), rel=0.01)


def test_looking_every_day_keeps_the_error_rate_where_a_daily_fixed_sample_test_loses_it():
    """2,000 candidates exactly as good as their champion, looked at after each of 30 days of 200 rows: the
    confidence sequence wrongly excludes 0 at some look in at most about alpha of them; a 95% interval
    recomputed every day does so several times as often (each look is another chance to be fooled)."""
    rng = np.random.default_rng(7)
    runs, days, per_day = 2_000, 30, 200
    d = rng.normal(0.0, 0.3, size=(runs, days * per_day))
    n = np.arange(per_day, days * per_day + 1, per_day)
    sums, sq = np.cumsum(d, axis=1)[:, n - 1], np.cumsum(d * d, axis=1)[:, n - 1]
    mean = sums / n
    sd = np.sqrt((sq - sums * sums / n) / (n - 1))
    rho_radius = np.array([radius(int(k), 1.0, ALPHA, planned_rows=3_000) for k in n])
    sequence_misses = (np.abs(mean) > sd * rho_radius).any(axis=1).mean()
    daily_misses = (np.abs(mean) > 1.96 * sd / np.sqrt(n)).any(axis=1).mean()
    assert sequence_misses <= ALPHA + 0.015, sequence_misses
    assert daily_misses > 3 * ALPHA, daily_misses


# ----------------------------------------------------------------------------- the decision
def evidence(mean: float, sd: float, n: int, seed: int = 3) -> Evidence:
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1, n)
    return Evidence().add(mean + sd * (x - x.mean()) / x.std(ddof=1))  # exactly this mean and sd


def test_a_fresher_candidate_no_worse_than_the_margin_is_released():
    out = decide(evidence(0.0, 0.2, 20_000), alpha=ALPHA, margin=0.01, planned_rows=5_000)
    assert out["verdict"] == "release" and out["lower"] > -0.01 and "non-inferior" in out["reason"]


def test_a_candidate_worse_beyond_the_margin_is_rejected_at_once():
    out = decide(evidence(-0.05, 0.2, 2_000), alpha=ALPHA, margin=0.01, planned_rows=5_000)
    assert out["verdict"] == "reject" and out["upper"] < -0.01


def test_an_undecided_candidate_waits_and_so_does_one_with_too_few_rows():
    close = decide(evidence(-0.005, 0.3, 1_000), alpha=ALPHA, margin=0.01, planned_rows=5_000)
    assert close["verdict"] == "wait" and close["lower"] < -0.01 < close["upper"]
    few = decide(evidence(0.5, 0.2, 50), alpha=ALPHA, margin=0.01, planned_rows=5_000, min_rows=100)
    assert few["verdict"] == "wait" and few["lower"] is None and "fewer than 100" in few["reason"]


def test_with_a_minimum_effect_only_a_better_candidate_is_released():
    level = evidence(0.0, 0.2, 20_000)
    assert decide(level, alpha=ALPHA, margin=0.01, planned_rows=5_000, min_effect=0.005)["verdict"] == "wait"
    better = decide(evidence(0.02, 0.2, 20_000), alpha=ALPHA, margin=0.01, planned_rows=5_000, min_effect=0.005)
    assert better["verdict"] == "release" and "minimum effect" in better["reason"]


def test_a_policy_that_cannot_be_met_is_refused():
    with pytest.raises(ValueError, match="margin"):
        decide(Evidence(), alpha=ALPHA, margin=-0.1, planned_rows=10)
    with pytest.raises(ValueError, match="alpha"):
        interval(evidence(0, 1, 10), alpha=1.5, planned_rows=10)


# ----------------------------------------------------------------------------- who carries the burden of proof
def test_with_the_burden_on_the_champion_an_undecided_candidate_is_released_and_harm_still_rejects():
    close = evidence(-0.005, 0.3, 1_000)  # the interval straddles -margin: the candidate's burden makes it wait
    assert decide(close, alpha=ALPHA, margin=0.01, planned_rows=5_000)["verdict"] == "wait"
    out = decide(close, alpha=ALPHA, margin=0.01, planned_rows=5_000, burden="champion")
    assert out["verdict"] == "release" and out["tested"] == "upper" and out["upper"] >= -0.01
    assert "not shown worse" in out["reason"]
    worse = decide(evidence(-0.05, 0.2, 2_000), alpha=ALPHA, margin=0.01, planned_rows=5_000, burden="champion")
    assert worse["verdict"] == "reject" and worse["upper"] < -0.01


def test_with_the_burden_on_the_champion_too_few_rows_still_wait():
    few = decide(evidence(0.5, 0.2, 50), alpha=ALPHA, margin=0.01, planned_rows=5_000, min_rows=100, burden="champion")
    assert few["verdict"] == "wait" and "fewer than 100" in few["reason"]


def test_a_minimum_effect_is_shown_by_the_candidate_never_presumed():
    with pytest.raises(ValueError, match="burden"):
        decide(evidence(0.02, 0.2, 100), alpha=ALPHA, margin=0.01, planned_rows=10, min_effect=0.0, burden="champion")
    with pytest.raises(ValueError, match="burden"):
        decide(evidence(0.02, 0.2, 100), alpha=ALPHA, margin=0.01, planned_rows=10, burden="nobody")
