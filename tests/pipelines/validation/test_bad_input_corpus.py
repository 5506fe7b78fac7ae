"""Bad-input corpus: the real validation stage (`validate_window`, real Great Expectations, the
production-like thresholds of configs/synthetic.yaml) on a lake holding a healthy window of synthetic
days plus ONE corrupted partition for the run's day.

Every corruption must
- fail the run with DataValidationError naming the right check at the right partition date,
- leave the input untouched (quarantine only adds `_validation.json` / `_validation_report.html`),
- quarantine the partition (marker status "quarantined" + HTML report) while the healthy days stay
  "passed" (their markers are reused, not rewritten),
- leave the model registry alone (no new version, @champion still v1).

And the stage must not cry wolf: a clean next day, a mildly shifted day, a re-run and a fixed
partition all pass (test_no_false_alarms.py). The healthy window, its sizes and the helpers are in
healthy_window.py, the fixtures in conftest.py.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Callable

import mlflow
import numpy as np
import pandas as pd
import pytest
from mlflow import MlflowClient

from pipelines.bench import faults
from pipelines.data import schema
from pipelines.data.lake import Lake
from pipelines.errors import DataValidationError
from pipelines.validation.stage import REPORT_HTML, read_marker, validate_window
from tests.pipelines.validation.healthy_window import (
    ADDED_BY_VALIDATION,
    DAY,
    HEALTHY,
    ROWS,
    SPEC,
    WINDOW,
    assign_some,
    config,
    failed_checks,
    objects,
    parquet_bytes,
    put_frame,
    put_parts,
    registry_state,
    rows_mask,
    synthetic,
)


def tomorrow() -> str:
    return (dt.datetime.now(dt.timezone.utc).date() + dt.timedelta(days=1)).isoformat()


# ----------------------------------------------------------------------------- the corpus
@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    corrupt: Callable[[Lake, str, pd.DataFrame], None]  # (lake, day, healthy rows of the day) -> writes the day
    expect: tuple[str, ...]  # check names that must be among the day's failures
    readable: bool = True
    day: Callable[[], str] = lambda: DAY


def frame_case(edit: Callable[[pd.DataFrame], pd.DataFrame]):
    """A corruption that edits a copy of the healthy rows and writes them as the day's only part file."""

    def corrupt(lk: Lake, day: str, healthy: pd.DataFrame) -> None:
        put_frame(lk, day, edit(healthy.copy()))

    return corrupt


def _label_float(f):
    f["label"] = 0.5
    return f


def _hour_strings(f):
    f["hour"] = f["hour"].astype(int).map(lambda h: f"{h:02d}h")
    return f


def _naive_ts(f):
    f["event_ts"] = f["event_ts"].dt.tz_localize(None)
    return f


def _extra_column(f):
    f["debug_payload"] = "x"
    return f


def _label_const(value: int):
    def edit(f):
        f["label"] = np.int8(value)
        return f

    return edit


def _nan_hour(f):
    f["hour"] = f["hour"].astype("float64").mask(rows_mask(f, 0.01), np.nan)
    return f


def _long_ids(f):
    f["user_id"] = f["user_id"].astype(object)
    f.loc[f.index[::1000], "user_id"] = "u" * 10_000  # 20 rows with 10 KB ids
    return f


def _duplicated_flood(f):
    dup = f[rows_mask(f, 0.2)]
    return pd.concat([f, dup], ignore_index=True).sort_values("event_ts", kind="stable", ignore_index=True)


def _other_day(lk: Lake, day: str, healthy: pd.DataFrame) -> None:
    """Yesterday's rows written again under today's date (a wrong dt= in the writer)."""
    put_frame(lk, day, synthetic(HEALTHY[-1]))


def _future_day(lk: Lake, day: str, healthy: pd.DataFrame) -> None:
    """Tomorrow's partition, already full of rows: a clock or replay bug upstream."""
    put_frame(lk, day, synthetic(day))


def _gender_shift(f):
    f["gender"] = f["gender"].mask(rows_mask(f, 0.9), "F").mask(~rows_mask(f, 0.9), "M")
    return f


def _slot_mix_shift(lk: Lake, day: str, healthy: pd.DataFrame) -> None:
    """Same world, but traffic moved to the splash screen (0.6/0.3/0.1 -> 0.2/0.3/0.5)."""
    put_frame(lk, day, synthetic(day, spec=dataclasses.replace(SPEC, slot_mix=(0.2, 0.3, 0.5))))


def _other_world(lk: Lake, day: str, healthy: pd.DataFrame) -> None:
    """Another seed is another world (other advertisers and verticals): the category mix moves."""
    put_frame(lk, day, synthetic(day, spec=dataclasses.replace(SPEC, seed=7)))


def _weekday_sunday0(f):
    f["weekday"] = ((f["weekday"].astype(int) + 1) % 7).astype("int8")  # Sunday=0 convention upstream
    return f


def _search_clicks_lost(f):
    lost = (f["slot"] == "search").to_numpy() & (f["label"] == 1).to_numpy() & rows_mask(f, 0.6)
    f.loc[lost, "label"] = 0  # click tracking broken on search: 60 % of its clicks never arrive
    return f


def _volume(fraction: float):
    def corrupt(lk: Lake, day: str, healthy: pd.DataFrame) -> None:
        put_frame(lk, day, synthetic(day, rows=int(ROWS * fraction)))

    return corrupt


def _missing_partition(lk: Lake, day: str, healthy: pd.DataFrame) -> None:
    pass  # the upstream export never ran


def _empty_partition(lk: Lake, day: str, healthy: pd.DataFrame) -> None:
    put_frame(lk, day, schema.to_arrow(healthy).slice(0, 0))


def _not_parquet(lk: Lake, day: str, healthy: pd.DataFrame) -> None:
    put_parts(lk, day, healthy.head(100).to_csv(index=False).encode())


def _truncated(lk: Lake, day: str, healthy: pd.DataFrame) -> None:
    payload = parquet_bytes(schema.to_arrow(healthy))
    put_parts(lk, day, payload[: len(payload) // 2])


def _uncommitted(lk: Lake, day: str, healthy: pd.DataFrame) -> None:
    """A writer killed mid-day: a healthy part file, but no manifest (never committed)."""
    lk.put_bytes(f"dt={day}/part-00000-killed.parquet", parquet_bytes(schema.to_arrow(healthy)))


def fault_case(name: str):
    """A fault of the backtest's fault suite (`bench.faults`: it keeps the contract), on the day's rows."""

    def corrupt(lk: Lake, day: str, healthy: pd.DataFrame) -> None:
        put_frame(lk, day, schema.to_arrow(faults.inject(name, healthy.copy(), lk.read_partition(HEALTHY[-1]).frame)))

    return corrupt


def _mixed_schemas(lk: Lake, day: str, healthy: pd.DataFrame) -> None:
    """Two writers: part 0 follows the contract, part 1 wrote hour/weekday as int64 and no advertiser_id."""
    half = len(healthy) // 2
    second = healthy.iloc[half:].drop(columns=["advertiser_id"]).astype({"hour": "int64", "weekday": "int64"})
    put_frame(lk, day, schema.to_arrow(healthy.iloc[:half]), second)


CASES = [
    # -- structure and types
    Case("missing_column_label", frame_case(lambda f: f.drop(columns=["label"])), ("expect_column_to_exist(label)",)),
    Case(
        "missing_column_gender", frame_case(lambda f: f.drop(columns=["gender"])), ("expect_column_to_exist(gender)",)
    ),
    Case("missing_column_hour", frame_case(lambda f: f.drop(columns=["hour"])), ("expect_column_to_exist(hour)",)),
    Case(
        "label_float_half",
        frame_case(_label_float),
        ("expect_column_values_to_be_in_type_list(label)", "expect_column_values_to_be_in_set(label)"),
    ),
    Case("hour_strings", frame_case(_hour_strings), ("expect_column_values_to_be_in_type_list(hour)",)),
    Case("event_ts_tz_naive", frame_case(_naive_ts), ("expect_column_values_to_be_of_type(event_ts)",)),
    Case("unexpected_extra_column", frame_case(_extra_column), ("expect_table_columns_to_match_set(table)",)),
    # -- nulls and domains
    Case(
        "null_user_id",
        frame_case(lambda f: assign_some(f, "user_id", 0.01, None)),
        ("expect_column_values_to_not_be_null(user_id)",),
    ),
    Case(
        "side_feature_nulls_over_max",
        frame_case(lambda f: assign_some(f, "gender", 0.2, None)),
        ("expect_column_values_to_not_be_null(gender)",),
    ),
    Case(
        "label_all_zero",
        frame_case(_label_const(0)),
        ("label_rate_vs_reference(all)", "expect_column_mean_to_be_between(label)"),
    ),
    Case(
        "label_all_one",
        frame_case(_label_const(1)),
        ("label_rate_vs_reference(all)", "expect_column_mean_to_be_between(label)"),
    ),
    Case(
        "label_value_2",
        frame_case(lambda f: assign_some(f, "label", 0.01, 2)),
        ("expect_column_values_to_be_in_set(label)",),
    ),
    Case(
        "unseen_slot",
        frame_case(lambda f: assign_some(f, "slot", 0.02, "banner")),
        ("expect_column_values_to_be_in_set(slot)",),
    ),
    Case(
        "hour_24", frame_case(lambda f: assign_some(f, "hour", 0.01, 24)), ("expect_column_values_to_be_between(hour)",)
    ),
    Case(
        "negative_weekday",
        frame_case(lambda f: assign_some(f, "weekday", 0.01, -1)),
        ("expect_column_values_to_be_between(weekday)",),
    ),
    Case("nan_hour", frame_case(_nan_hour), ("expect_column_values_to_not_be_null(hour)",)),
    Case("ten_kb_user_ids", frame_case(_long_ids), ("expect_column_value_lengths_to_be_between(user_id)",)),
    Case(
        "empty_item_ids",
        frame_case(lambda f: assign_some(f, "item_id", 0.01, "")),
        ("expect_column_value_lengths_to_be_between(item_id)",),
    ),
    # -- rows, time and volume
    Case("duplicated_rows_flood", frame_case(_duplicated_flood), ("duplicate_impressions",)),
    Case("rows_from_another_day", _other_day, ("event_ts_in_partition_day",)),
    Case("future_timestamps", _future_day, ("no_future_event_ts",), day=tomorrow),
    Case("volume_collapse_1pct", _volume(0.01), ("volume_vs_reference", "expect_table_row_count_to_be_between(table)")),
    Case("volume_drop_30pct", _volume(0.3), ("volume_vs_reference",)),
    Case("volume_spike_3x", _volume(3.0), ("volume_vs_reference",)),
    # -- distribution
    Case("gender_shift_90pct_f", frame_case(_gender_shift), ("drift_psi(gender)",)),
    Case("slot_mix_shift", _slot_mix_shift, ("drift_psi(slot)",)),
    Case("weekday_convention_bug", frame_case(_weekday_sunday0), ("drift_psi(weekday)",)),
    Case("catalogue_swap_other_seed", _other_world, ("drift_psi(category)",)),
    Case("search_clicks_lost", frame_case(_search_clicks_lost), ("label_rate_vs_reference(search)",)),
    # -- meaning: faults that keep the contract (the backtest's fault suite; flipped labels are the gate's)
    Case("fault_shuffle_items", fault_case("shuffle_items"), ("item_category_consistency",)),
    Case("fault_constant_feature", fault_case("constant_feature"), ("stuck_column[category]",)),
    Case("fault_restamped_yesterday", fault_case("restamped_yesterday"), ("replayed_rows",)),
    Case("fault_label_leak", fault_case("label_leak"), ("label_leak",)),
    Case("fault_single_slot", fault_case("single_slot"), ("stuck_column[slot]", "missing_slot[search]")),
    # -- unreadable input
    Case("missing_partition", _missing_partition, ("readable_partition",), readable=False),
    Case("empty_partition", _empty_partition, ("readable_partition",), readable=False),
    Case("not_parquet", _not_parquet, ("readable_partition",), readable=False),
    Case("truncated_parquet", _truncated, ("readable_partition",), readable=False),
    Case("uncommitted_partition", _uncommitted, ("readable_partition",), readable=False),
    Case("mixed_schemas", _mixed_schemas, ("readable_partition",), readable=False),
]
BY_ID = {c.id: c for c in CASES}


def run_case(case: Case, lake_uri: str, healthy: pd.DataFrame) -> tuple[str, DataValidationError, dict, dict]:
    """Corrupt the run day, validate the window, assert the common invariants; returns what the test needs."""
    lk = Lake(lake_uri)
    day = case.day()
    case.corrupt(lk, day, healthy)
    before = objects(lk, day)
    healthy_before = {d: objects(lk, d) for d in HEALTHY}
    assert case.id == "missing_partition" or before, "the corruption wrote nothing"
    assert not ADDED_BY_VALIDATION & set(before)

    with pytest.raises(DataValidationError) as info:
        validate_window(config(lake_uri), lake_uri, day, WINDOW, log_to_mlflow=True)
    exc = info.value
    checks = failed_checks(exc)
    for name in case.expect:
        assert f"{name} @ dt={day}" in checks, f"{case.id}: {name} not among {checks}"
    # only the corrupted day failed
    assert all(c.endswith(f" @ dt={day}") for c in checks), checks
    if case.readable:
        assert f"readable_partition @ dt={day}" not in checks
    else:
        assert checks == [f"readable_partition @ dt={day}"]

    # quarantine never deletes or rewrites input; it only adds the marker and the HTML report
    after = objects(lk, day)
    assert {k: v for k, v in after.items() if k in before} == before
    assert set(after) - set(before) <= ADDED_BY_VALIDATION
    # the healthy days are untouched: markers reused (same bytes), still "passed"
    assert {d: objects(lk, d) for d in HEALTHY} == healthy_before
    for d in HEALTHY:
        assert read_marker(lk, d)["status"] == "passed"

    marker = read_marker(lk, day)
    if before:  # something to quarantine: marker + HTML next to the partition
        assert set(after) - set(before) == ADDED_BY_VALIDATION
        assert marker["status"] == "quarantined" and marker["report"]["quarantined"] is True
        assert {f"{f['check']} @ dt={day}" for f in marker["report"]["failures"]} == set(checks)
        html = after[REPORT_HTML].decode()
        assert html.lstrip().lower().startswith("<!doctype html") and day in html
    else:  # a missing partition gets no marker: there is nothing to quarantine
        assert marker is None and after == {}

    # registry untouched: no new version, @champion still v1, no alias move
    assert registry_state() == (["1"], "1", 1)
    return day, exc, marker, after


# ----------------------------------------------------------------------------- corpus tests
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_quarantined_with_the_right_check(case, lake, healthy_next_day, registry):
    day, exc, marker, _ = run_case(case, str(lake), healthy_next_day)
    assert f"dt={day}" in str(exc) and exc.where == f"{lake} window ending {day}"
    # the validation run itself is logged (tracking), failed, next to the untouched registry
    runs = MlflowClient().search_runs([mlflow.get_experiment_by_name("ctr-data-validation").experiment_id])
    assert len(runs) == 1 and runs[0].data.tags["success"] == "False"
    if case.id == "ten_kb_user_ids":  # a 10 KB value is reported, not copied into the marker
        sample = next(
            f
            for f in marker["report"]["failures"]
            if f["check"] == "expect_column_value_lengths_to_be_between(user_id)"
        )["observed"]["sample"]
        assert sample and all(len(s) < 100 and s.endswith("(10000 chars)") for s in sample)
    if case.id == "uncommitted_partition":  # parts a killed writer left are never judged as data
        assert "is not committed (no _MANIFEST.json)" in marker["report"]["failures"][0]["observed"]
    if case.readable and case.id.startswith(("missing_column", "hour_strings", "label_float", "event_ts_tz")):
        assert marker["report"]["drift"] is None  # drift needs a structurally sound partition


@pytest.mark.parametrize("case_id", ["label_all_zero", "truncated_parquet", "missing_partition"])
def test_bad_input_on_s3(case_id, template_lake, healthy_next_day, registry, s3_bucket):
    """The same corpus entries over a real S3 API (moto over HTTP)."""
    lake_uri = f"s3://{s3_bucket}/synthetic"
    lk = Lake(lake_uri)
    for p in sorted(template_lake.rglob("*")):
        if p.is_file():
            lk.put_bytes(str(p.relative_to(template_lake)), p.read_bytes())
    assert lk.list_partitions() == HEALTHY
    run_case(BY_ID[case_id], lake_uri, healthy_next_day)
