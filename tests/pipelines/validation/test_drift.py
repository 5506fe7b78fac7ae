"""Drift of a click-log partition against a reference window: the statistics against hand-computed values,
the reference profile (streaming, JSON), and synthetic scenarios that must pass or fail by the numbers."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from pipelines.data.synthetic import SyntheticSpec, generate_day
from pipelines.validation.drift import (
    CATEGORICAL,
    NULL,
    NUMERIC,
    ReferenceProfile,
    drift_checks,
    numeric_drift,
    profile,
    psi,
)

SPEC = SyntheticSpec()
REF_DAYS = ("2024-01-02", "2024-01-03", "2024-01-04")  # Tuesday .. Thursday
NEXT_DAY = "2024-01-05"  # Friday
ROWS = 100_000
CHECKS = [f"drift_psi({c})" for c in CATEGORICAL + NUMERIC]


def day(d: str, rows: int = ROWS, spec: SyntheticSpec = SPEC, chunk_rows: int = 500_000) -> pd.DataFrame:
    return pd.concat(list(generate_day(spec, d, rows, chunk_rows)), ignore_index=True)


@pytest.fixture(scope="module")
def ref_frames() -> list[pd.DataFrame]:
    return [day(d) for d in REF_DAYS]


@pytest.fixture(scope="module")
def ref(ref_frames) -> ReferenceProfile:
    return profile(ref_frames)


@pytest.fixture(scope="module")
def next_day() -> pd.DataFrame:
    return day(NEXT_DAY)


def observed(report: dict) -> dict:
    return {c["check"]: c["observed"] for c in report["checks"]}


def failed(report: dict) -> set:
    return {c["check"] for c in report["checks"] if not c["passed"]}


# ------------------------------------------------------------------------------------ statistics
def test_psi_matches_hand_computed_values():
    # (0.25 - 0.5) ln(0.25 / 0.5) + (0.75 - 0.5) ln(0.75 / 0.5) = 0.25 ln 2 + 0.25 ln 1.5
    assert psi({"a": 0.5, "b": 0.5}, {"a": 0.25, "b": 0.75}) == pytest.approx(0.27465307216, abs=1e-10)
    # The slot-mix move of the brief: 0.4 ln 3 + 0 + 0.4 ln 5 = 1.0832, far past "significant" (0.2).
    shift = psi({"feed": 0.6, "search": 0.3, "splash": 0.1}, {"feed": 0.2, "search": 0.3, "splash": 0.5})
    assert shift == pytest.approx(0.4 * math.log(3) + 0.4 * math.log(5), abs=1e-12) and shift > 0.2
    # A few points of mix change stays under "small" (0.1): 0.05 ln(.6/.55) + .02 ln(.32/.3) + .03 ln(1.3)
    small = psi({"feed": 0.6, "search": 0.3, "splash": 0.1}, {"feed": 0.55, "search": 0.32, "splash": 0.13})
    assert small == pytest.approx(0.0135123, abs=1e-6) and small < 0.1
    # Counts are normalised: the same mixes given as counts give the same PSI.
    assert psi({"a": 50, "b": 50}, {"a": 25, "b": 75}) == pytest.approx(0.27465307216, abs=1e-10)


def test_psi_of_identical_distributions_is_zero():
    p = {"M": 0.52, "F": 0.46, NULL: 0.02}
    assert psi(p, dict(p)) == 0.0
    assert psi(p, {k: v * 1000 for k, v in p.items()}) == pytest.approx(0.0, abs=1e-15)


def test_psi_of_an_unseen_or_vanished_category_is_finite():
    # "b" is new: its reference share is floored at eps = 1e-4:
    # (0.9 - 1) ln(0.9) + (0.1 - 1e-4) ln(0.1 / 1e-4) = 0.0105361 + 0.6900848
    v = psi({"a": 1.0}, {"a": 0.9, "b": 0.1})
    assert math.isfinite(v) and v == pytest.approx(0.1 * math.log(1 / 0.9) + 0.0999 * math.log(1000), abs=1e-12)
    assert v == pytest.approx(0.7006208, abs=1e-6)
    assert psi({"a": 0.9, "b": 0.1}, {"a": 1.0}) == pytest.approx(v, abs=1e-12)  # vanished: same, PSI is symmetric
    assert psi({"a": 1.0}, {"a": 0.9, "b": 0.1}, eps=1e-3) < v  # larger eps, milder penalty


def test_empty_distribution_is_refused():
    with pytest.raises(ValueError, match="empty distribution"):
        psi({"a": 1.0}, {})


def test_numeric_drift_matches_hand_computed_values():
    uniform = [1 / 24] * 24 + [0.0]  # hour sketch: 24 values + the overflow bin
    same = numeric_drift(uniform, np.repeat(np.arange(24, dtype=np.int8), 10))
    assert same["psi"] == pytest.approx(0.0, abs=1e-12) and same["statistic"] == pytest.approx(0.0, abs=1e-12)
    all3 = numeric_drift(uniform, np.full(1000, 3, dtype=np.int8))
    # bin 3: (1 - 1/24) ln 24; the 23 emptied bins: (1e-4 - 1/24) ln(1e-4 * 24); the overflow bin: 0.
    hand = (1 - 1 / 24) * math.log(24) + 23 * (1e-4 - 1 / 24) * math.log(1e-4 * 24)
    assert all3["psi"] == pytest.approx(hand, abs=1e-12) and all3["psi"] > 0.2
    assert all3["statistic"] == pytest.approx(20 / 24, abs=1e-12)  # CDFs differ most just below 3: 0 vs 3/24 ...
    # Out-of-domain, null and non-integral values all land in the overflow bin: finite PSI, all mass moved.
    odd = numeric_drift(uniform, np.array([99.0, np.nan, -1.0, 2.5]))
    assert math.isfinite(odd["psi"]) and odd["statistic"] == pytest.approx(1.0, abs=1e-12)


# ------------------------------------------------------------------------------------ profile
def test_profile_summarises_the_window(ref, ref_frames):
    assert ref.rows == 3 * ROWS and ref.partitions == 3
    for c in CATEGORICAL:
        assert sum(ref.categorical[c].values()) == pytest.approx(1.0, abs=1e-12)
    assert set(ref.categorical["slot"]) == {"feed", "search", "splash"}
    assert ref.categorical["slot"]["feed"] == pytest.approx(0.6, abs=0.01)
    assert len(ref.numeric["hour"]) == 25 and len(ref.numeric["weekday"]) == 8
    assert ref.numeric["weekday"] == [1.0] + [0.0] * 7  # weekday agrees with the event's UTC date on every row
    users = pd.concat([f["user_id"] for f in ref_frames]).nunique()
    assert len(ref.user_ids.array) == users and not ref.user_ids.sampled  # exact below the cap


def test_profile_records_nulls_as_a_category(ref_frames):
    f = ref_frames[0].head(1000).copy()
    f.loc[:99, "gender"] = pd.NA
    p = profile([f])
    assert p.categorical["gender"][NULL] == pytest.approx(0.1)
    assert sum(p.categorical["gender"].values()) == pytest.approx(1.0)


@pytest.mark.parametrize("max_ids", [1 << 18, 5_000])  # exact, then a bottom-k sample of the ids
def test_streaming_profile_equals_profile_of_the_concatenation(ref_frames, max_ids):
    chunks = (c for d in REF_DAYS for c in generate_day(SPEC, d, ROWS, chunk_rows=30_000))
    streamed = profile(chunks, max_ids=max_ids)
    whole = profile([pd.concat(ref_frames, ignore_index=True)], max_ids=max_ids)
    assert streamed == whole
    assert streamed.user_ids.sampled is (max_ids == 5_000)
    assert len(streamed.user_ids.array) == min(max_ids, pd.concat(ref_frames)["user_id"].nunique())


@pytest.mark.parametrize("max_ids", [1 << 18, 5_000])
def test_profile_round_trips_through_json(ref_frames, max_ids):
    p = profile(ref_frames, max_ids=max_ids)
    text = json.dumps(p.to_json())
    back = ReferenceProfile.from_json(json.loads(text))
    assert back == p
    assert np.array_equal(back.user_ids.array, p.user_ids.array) and back.item_ids.sampled == p.item_ids.sampled


def test_empty_inputs_are_refused(next_day, ref):
    with pytest.raises(ValueError, match="empty reference"):
        profile([next_day.head(0)])
    with pytest.raises(ValueError, match="empty frame"):
        drift_checks(next_day.head(0), ref)


# ------------------------------------------------------------------------------------ scenarios
def test_next_day_of_a_healthy_log_passes_well_below_small(ref, ref_frames, next_day):
    report = drift_checks(next_day, ref)
    assert [c["check"] for c in report["checks"]] == CHECKS
    assert failed(report) == set()
    assert all(v < 0.1 for v in observed(report).values()), observed(report)
    assert json.loads(json.dumps(report)) == report
    assert all(c["expected"] == "<= 0.2" for c in report["checks"])
    # Against yesterday alone as well.
    single = drift_checks(next_day, profile(ref_frames[-1:]))
    assert all(v < 0.1 for v in observed(single).values()), observed(single)


def test_plain_pandas_dtypes_give_the_same_report(ref, next_day):
    plain = next_day.astype({c: object for c in ("user_id", "item_id", *CATEGORICAL)})
    plain = plain.astype({"hour": "int64", "weekday": "float64"})
    assert drift_checks(plain, ref) == drift_checks(next_day, ref)


def test_gender_flip_fails_drift_psi_gender(ref, next_day):
    f = next_day.copy()
    f["gender"] = pd.Series(np.where(np.random.default_rng(1).random(len(f)) < 0.9, "F", "M"), dtype="string")
    report = drift_checks(f, ref)
    assert failed(report) == {"drift_psi(gender)"}
    assert observed(report)["drift_psi(gender)"] > 0.2


def test_slot_mix_shift_fails_drift_psi_slot(ref):
    shifted = day(NEXT_DAY, spec=SyntheticSpec(slot_mix=(0.2, 0.3, 0.5)))
    report = drift_checks(shifted, ref)
    assert failed(report) == {"drift_psi(slot)"}
    assert observed(report)["drift_psi(slot)"] == pytest.approx(1.08, abs=0.03)  # ~ the hand value 1.0832


def test_hour_collapse_fails_drift_psi_hour(ref, next_day):
    f = next_day.assign(hour=np.int8(3))
    report = drift_checks(f, ref)
    assert failed(report) == {"drift_psi(hour)"}
    assert observed(report)["drift_psi(hour)"] > 1.0


def test_weekday_is_checked_against_the_calendar(ref, ref_frames, next_day):
    # The raw weekday mix of a daily partition always "drifts" from the window (Friday vs Tue-Thu) ...
    raw_ref = pd.concat([f["weekday"] for f in ref_frames]).value_counts().to_dict()
    assert psi(raw_ref, next_day["weekday"].value_counts().to_dict()) > 5
    # ... so the check is on the weekday's offset to the event's UTC date: a healthy Friday passes,
    assert observed(drift_checks(next_day, ref))["drift_psi(weekday)"] == 0.0
    # and a Sunday=0 convention bug (every weekday off by one) fails.
    bug = next_day.assign(weekday=((next_day["weekday"] + 1) % 7).astype("int8"))
    assert failed(drift_checks(bug, ref)) == {"drift_psi(weekday)"}


def test_custom_thresholds(ref, next_day):
    f = next_day.copy()
    f["gender"] = pd.Series(np.where(np.random.default_rng(2).random(len(f)) < 0.6, "F", "M"), dtype="string")
    v = observed(drift_checks(f, ref))["drift_psi(gender)"]
    assert 0.01 < v < 0.2  # 48 % -> 60 % F: a real but not "significant" move
    tight = drift_checks(f, ref, psi_max=0.01)
    assert failed(tight) == {"drift_psi(gender)"} and tight["checks"][1]["expected"] == "<= 0.01"
    assert failed(drift_checks(f.assign(hour=np.int8(3)), ref, numeric_psi_max=100.0)) == set()


# ------------------------------------------------------------------------------------ unseen ids
def test_unseen_rates(ref, ref_frames, next_day):
    assert drift_checks(ref_frames[1], ref)["unseen"] == {"user_rate": 0.0, "item_rate": 0.0, "rows": ROWS}
    all_new = ref_frames[1].assign(user_id="new-" + ref_frames[1]["user_id"])
    assert drift_checks(all_new, ref)["unseen"] == {"user_rate": 1.0, "item_rate": 0.0, "rows": ROWS}
    # The next day: 5 % of rows come from users (and items) born that day, plus base users not yet seen.
    unseen = drift_checks(next_day, ref)["unseen"]
    assert 0.05 <= unseen["item_rate"] < 0.08 and 0.05 <= unseen["user_rate"] < 0.4
    # Reported, never failed: a frame of only new users still passes every check.
    assert failed(drift_checks(all_new, ref)) == set()


def test_unseen_rates_from_a_sampled_sketch(ref, ref_frames, next_day):
    sampled = profile(ref_frames, max_ids=10_000)  # keeps ~7 % of the users, ~47 % of the items
    assert sampled.user_ids.sampled and sampled.item_ids.sampled
    assert drift_checks(ref_frames[1], sampled)["unseen"] == {"user_rate": 0.0, "item_rate": 0.0, "rows": ROWS}
    all_new = ref_frames[1].assign(user_id="new-" + ref_frames[1]["user_id"], item_id="new-" + ref_frames[1]["item_id"])
    assert drift_checks(all_new, sampled)["unseen"] == {"user_rate": 1.0, "item_rate": 1.0, "rows": ROWS}


def test_sampled_unseen_rate_is_unbiased_with_bounded_error(ref, ref_frames, next_day):
    # Salting the ids draws a different hash sample each time; keep ~7 % of the users, ~47 % of the items.
    exact = drift_checks(next_day, ref)["unseen"]
    err = {"user_rate": [], "item_rate": []}
    for salt in range(8):

        def salted(f):
            return f.assign(user_id=f"{salt}:" + f["user_id"], item_id=f"{salt}:" + f["item_id"])

        sampled = profile([salted(f) for f in ref_frames], max_ids=10_000)
        got = drift_checks(salted(next_day), sampled)["unseen"]
        for k in err:
            err[k].append(got[k] - exact[k])
    for k, e in err.items():
        assert abs(np.mean(e)) < 0.015 and np.max(np.abs(e)) < 0.05, (k, e)
