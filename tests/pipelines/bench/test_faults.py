"""The fault suite's faults (`bench.faults`): each does what its name says and keeps the contract, so
what stops it in `backtest --faults` is judgement (validation's consistency checks, the gate), not the
schema. Which check stops which fault: tests/pipelines/validation/test_bad_input_corpus.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest

from pipelines.bench import faults
from pipelines.bench.backtest_faults import CONTRACT_CHECKS, plan
from pipelines.config import REPO_ROOT, load_pipeline_config
from pipelines.data.synthetic import SyntheticSpec, generate_day
from pipelines.errors import ConfigError
from pipelines.validation.suite import validate_frame

DAY, BEFORE = "2026-06-09", "2026-06-08"
CFG = load_pipeline_config(REPO_ROOT / "configs" / "synthetic.yaml")


def synthetic(day: str) -> pd.DataFrame:
    return pd.concat(list(generate_day(SyntheticSpec(), day, 3_000)), ignore_index=True)


@pytest.fixture(scope="module")
def day() -> pd.DataFrame:
    return synthetic(DAY)


@pytest.fixture(scope="module")
def previous() -> pd.DataFrame:
    return synthetic(BEFORE)


@pytest.mark.parametrize("name", sorted(faults.FAULTS))
def test_every_fault_keeps_the_contract(name, day, previous):
    bad = faults.inject(name, day.copy(), previous)
    report = validate_frame(bad, CFG.validation, CFG.data.slots, where=name, day=DAY)
    broken = [f["check"] for f in report["failures"] if f["check"].startswith(CONTRACT_CHECKS)]
    assert broken == [] and len(bad) > 0
    assert list(bad.columns) == list(day.columns) and (bad.dtypes == day.dtypes).all()


def test_flip_labels_flips_every_label_and_nothing_else(day, previous):
    bad = faults.inject("flip_labels", day.copy(), previous)
    assert ((bad["label"] + day["label"]) == 1).all()
    assert bad.drop(columns="label").equals(day.drop(columns="label"))


def test_shuffle_items_permutes_the_item_ids_only(day, previous):
    bad = faults.inject("shuffle_items", day.copy(), previous)
    assert sorted(bad["item_id"]) == sorted(day["item_id"]) and (bad["item_id"] != day["item_id"]).mean() > 0.9
    assert bad.drop(columns="item_id").equals(day.drop(columns="item_id"))


def test_constant_feature_sticks_category_at_its_mode(day, previous):
    bad = faults.inject("constant_feature", day.copy(), previous)
    assert set(bad["category"]) == {day["category"].mode().iloc[0]}


def test_restamped_yesterday_resends_the_day_before_on_this_day(day, previous):
    bad = faults.inject("restamped_yesterday", day.copy(), previous)
    ts, old = pd.to_datetime(bad["event_ts"], utc=True), pd.to_datetime(previous["event_ts"], utc=True)
    assert len(bad) == len(previous) and (ts.dt.strftime("%Y-%m-%d") == DAY).all()
    assert ((ts - old) == pd.Timedelta(days=1)).all()  # the time of day kept to the microsecond
    assert (bad["weekday"] == ts.dt.weekday).all() and bad["user_id"].equals(previous["user_id"])


def test_label_leak_puts_the_label_in_the_hour(day, previous):
    bad = faults.inject("label_leak", day.copy(), previous)
    assert ((bad["hour"] >= 12) == (bad["label"] == 1)).all() and bad["hour"].between(0, 23).all()


def test_single_slot_keeps_the_largest_slot_only(day, previous):
    bad = faults.inject("single_slot", day.copy(), previous)
    largest = day["slot"].value_counts().idxmax()
    assert set(bad["slot"]) == {largest} and len(bad) == (day["slot"] == largest).sum()


def test_an_unknown_fault_is_a_config_error(day, previous):
    with pytest.raises(ConfigError, match="unknown fault 'typo'"):
        faults.inject("typo", day, previous)


def test_the_plan_keeps_the_first_day_clean_and_injects_one_fault_a_day():
    dates = [f"1998-03-{d:02d}" for d in range(7, 14)]
    assert plan(dates) == dict(zip(dates[1:], faults.FAULTS)) and dates[0] not in plan(dates)
    with pytest.raises(ValueError, match="needs 7 days"):
        plan(dates[:6])


@pytest.mark.slow
def test_the_fault_suite_names_what_stopped_each_fault_before_serving(tmp_path):
    """`backtest --faults` on MovieLens' --quick days: the pipeline itself (validation, retrain, gate, release)."""
    out = subprocess.run(
        [sys.executable, "-m", "pipelines", "backtest", "--faults", "--served-dir", str(tmp_path / "replay"), "--json"],
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    )
    r = json.loads(out.stdout)
    entries = {e["fault"]: e for e in r["faults"]}
    assert list(r["faults_caught"]) == list(faults.FAULTS) and all(e["kept_the_contract"] for e in entries.values())
    assert {e["day"]: f for f, e in entries.items()} == plan([f"1998-03-{d:02d}" for d in range(7, 15)])
    stopped = {
        "shuffle_items": "item_category_consistency",
        "constant_feature": "stuck_column[category]",
        "restamped_yesterday": "replayed_rows",
        "label_leak": "label_leak",
    }
    for fault, check in stopped.items():
        assert r["faults_caught"][fault] == "validation" and check in entries[fault]["failed_checks"], entries[fault]
    # MovieLens runs without a label-rate band tight enough to see a flip: judged on the flipped rows, what
    # waits falls below the AUC floor (the first-run one: the faults keep the first champions from coming)
    assert r["faults_caught"]["flip_labels"] == "gate"
    assert {"auc_floor", "auc_floor_every_run"} & set(entries["flip_labels"]["failed_checks"]), entries["flip_labels"]
    # MovieLens' slot is the time of day and a day has a dozen raters: one slot all day is what its data does
    # (docs/benchmarks.md, fault suite); on an ad log the missing_slot check stops it (test_bad_input_corpus.py)
    assert r["faults_caught"]["single_slot"] is None
    assert r["all_caught"] is False
