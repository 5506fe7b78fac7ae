"""The click-log expectation suite, run with real Great Expectations on small pandas frames."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from pipelines.config import ValidationConfig
from pipelines.data import schema
from pipelines.errors import DataValidationError
from pipelines.validation.suite import build_suite, validate_frame

SLOTS = ("feed", "search", "splash")
CFG = ValidationConfig(
    label_rate_min=0.01, label_rate_max=0.9, min_rows=1, max_null_fraction_side=0.05, max_id_length=64
)


def make_frame(n: int = 500, seed: int = 0) -> pd.DataFrame:
    """A valid click log with pandas' default dtypes (pandas 3: `str` for strings)."""
    rng = np.random.default_rng(seed)
    return pd.DataFrame(
        {
            "event_ts": pd.date_range("2024-01-01", periods=n, freq="min", tz="UTC"),
            "user_id": [f"u{i % 50}" for i in range(n)],
            "item_id": [f"i{i % 70}" for i in range(n)],
            "slot": rng.choice(SLOTS, n),
            "label": (rng.random(n) < 0.2).astype("int8"),
            "age_bucket": rng.choice(["18-24", "25-34", "35-44"], n),
            "gender": rng.choice(["M", "F"], n),
            "occupation": rng.choice(["student", "engineer"], n),
            "category": rng.choice(["Drama", "Comedy"], n),
            "hour": rng.integers(0, 24, n).astype("int8"),
            "weekday": rng.integers(0, 7, n).astype("int8"),
        }
    )


def checks(report: dict) -> list[str]:
    return [f["check"] for f in report["failures"]]


def failure(report: dict, check: str) -> dict:
    return next(f for f in report["failures"] if f["check"] == check)


def test_valid_frame_passes_with_a_json_safe_report():
    frame = make_frame()
    before = frame.copy()
    report = validate_frame(frame, CFG, SLOTS, where="clicks/2024-01-01")
    assert report["success"] is True and report["failures"] == []
    assert report["where"] == "clicks/2024-01-01" and report["rows"] == 500
    assert report["suite"] == "click_log_contract" and report["gx_version"].startswith("1.")
    assert report["evaluated"] == len(build_suite(CFG, SLOTS).expectations) > 30
    assert json.loads(json.dumps(report)) == report
    pd.testing.assert_frame_equal(frame, before)  # validation must not touch the caller's frame


def test_suite_is_generated_from_the_contract_and_config():
    cfg = ValidationConfig(max_null_fraction_side=0.2, max_id_length=12, min_rows=7)
    suite = build_suite(cfg, ["a", "b"])
    assert suite.name == "click_log_contract"
    by_check = {f"{e.expectation_type}({getattr(e, 'column', None) or 'table'})": e for e in suite.expectations}
    for name in schema.REQUIRED:
        assert f"expect_column_to_exist({name})" in by_check
        assert f"expect_column_values_to_not_be_null({name})" in by_check
    assert "expect_column_to_exist(advertiser_id)" not in by_check  # optional in the contract
    assert by_check["expect_column_values_to_not_be_null(gender)"].mostly == pytest.approx(0.8)
    assert by_check["expect_column_values_to_not_be_null(user_id)"].mostly == 1.0
    assert by_check["expect_column_values_to_be_in_set(slot)"].value_set == ["a", "b"]
    assert by_check["expect_column_value_lengths_to_be_between(item_id)"].max_value == 12
    assert by_check["expect_table_row_count_to_be_between(table)"].min_value == 7


@pytest.mark.parametrize("variant", ["pandas_default", "conformed", "object", "with_optional_column"])
def test_string_dtype_flavours_all_pass(variant):
    frame = make_frame()
    if variant == "conformed":
        frame = schema.conform(frame)  # `string` (NA) dtypes, int8, datetime64[us, UTC]
    elif variant == "object":
        frame = frame.astype({c: object for c in ("user_id", "item_id", "slot", "gender")})
    elif variant == "with_optional_column":
        frame["advertiser_id"] = "adv1"
    report = validate_frame(frame, CFG, SLOTS)
    assert report["success"], report["failures"]


def test_wrong_dtypes_fail_the_type_checks():
    frame = make_frame()
    frame["label"] = frame["label"].astype(float)
    frame["event_ts"] = frame["event_ts"].dt.tz_localize(None)
    frame["user_id"] = np.arange(len(frame))
    report = validate_frame(frame, CFG, SLOTS)
    assert failure(report, "expect_column_values_to_be_in_type_list(label)")["observed"] == "float64"
    assert "expect_column_values_to_be_of_type(event_ts)" in checks(report)
    assert "expect_column_values_to_be_of_type(user_id)" in checks(report)


def _drop_label(f):
    return f.drop(columns=["label"])


def _bad_slot(f):
    f.loc[3, "slot"] = "promo"
    return f


def _hour_24(f):
    f.loc[5, "hour"] = 24
    return f


def _no_clicks(f):
    f["label"] = np.int8(0)
    return f


def _null_user(f):
    f.loc[7, "user_id"] = None
    return f


def _extra_column(f):
    f["debug_note"] = "x"
    return f


def _huge_id(f):
    f.loc[9, "item_id"] = "i" * 10_000
    return f


@pytest.mark.parametrize(
    "mutate, check, observed_has",
    [
        (_drop_label, "expect_column_to_exist(label)", "missing column label"),
        (_bad_slot, "expect_column_values_to_be_in_set(slot)", "promo"),
        (_hour_24, "expect_column_values_to_be_between(hour)", "24"),
        (_no_clicks, "expect_column_mean_to_be_between(label)", "0.0"),
        (_null_user, "expect_column_values_to_not_be_null(user_id)", "'unexpected_count': 1"),
        (_extra_column, "expect_table_columns_to_match_set(table)", "debug_note"),
        (_huge_id, "expect_column_value_lengths_to_be_between(item_id)", "(10000 chars)"),
    ],
    ids=["missing_column", "bad_slot", "hour_24", "label_rate_zero", "null_user_id", "extra_column", "huge_id"],
)
def test_bad_frame_is_reported_with_the_failed_check_and_what_was_observed(mutate, check, observed_has):
    frame = mutate(make_frame())
    report = validate_frame(frame, CFG, SLOTS, where="bad")
    assert report["success"] is False
    assert check in checks(report)
    assert observed_has in str(failure(report, check)["observed"])
    assert failure(report, check)["expected"]
    assert len(json.dumps(report)) < 5_000  # short enough for a task log / XCom, even with a 10k-char id

    assert f"FAILED {check}" in str(DataValidationError("bad", report["failures"]))  # what the stage raises


def test_missing_column_is_reported_once_per_dependent_check_without_crashing():
    report = validate_frame(_drop_label(make_frame()), CFG, SLOTS)
    label_checks = [f for f in report["failures"] if f["check"].endswith("(label)")]
    assert label_checks[0]["check"] == "expect_column_to_exist(label)"  # suite order: existence first
    assert all(f["observed"] == "missing column label" for f in label_checks)
    assert report["evaluated"] == len(build_suite(CFG, SLOTS).expectations)


def test_side_feature_nulls_are_tolerated_up_to_the_configured_fraction():
    frame = make_frame()
    frame.loc[:14, "gender"] = None  # 3% null
    assert validate_frame(frame, CFG, SLOTS)["success"]
    frame.loc[:49, "gender"] = None  # 10% null
    report = validate_frame(frame, CFG, SLOTS)
    assert checks(report) == ["expect_column_values_to_not_be_null(gender)"]


def test_too_few_rows_fail_the_row_count():
    report = validate_frame(make_frame(n=50), ValidationConfig(min_rows=100), SLOTS)
    assert checks(report) == ["expect_table_row_count_to_be_between(table)"]
    assert failure(report, "expect_table_row_count_to_be_between(table)")["observed"] == 50


def test_results_never_leak_between_frames():
    # GX gives every dataframe batch of this asset the same batch id and caches metrics per engine;
    # alternating frames must still be judged on their own data.
    good, bad = make_frame(), _no_clicks(make_frame())
    outcomes = [validate_frame(f, CFG, SLOTS)["success"] for f in (good, bad, good, bad)]
    assert outcomes == [True, False, True, False]
