"""The promotion gate's pure decision and its table rendering."""
from __future__ import annotations

import json

import numpy as np
import pytest

from pipelines.config import GatePolicy, to_dict
from pipelines.promotion.gate import decide, format_table

POLICY = GatePolicy(auc_tolerance=0.0015, min_auc_first_run=0.6, max_logloss_first_run=0.75)


def first_run(auc, logloss) -> dict:
    return {"candidate": {"auc": auc, "logloss": logloss}, "champion": None, "champion_version": None}


def vs_champion(cand_auc, champ_auc, version="3") -> dict:
    return {"candidate": {"auc": cand_auc, "logloss": 0.3}, "champion": {"auc": champ_auc, "logloss": 0.3},
            "champion_version": version}


def check(decision: dict, name: str) -> dict:
    return next(c for c in decision["checks"] if c["name"] == name)


# ----------------------------------------------------------------------------- first run
def test_first_run_passes_above_floor_and_below_ceiling():
    d = decide(POLICY, first_run(0.7, 0.5))
    assert d["passed"] is True and d["first_run"] is True and d["champion_version"] is None
    assert [c["name"] for c in d["checks"]] == ["auc_floor", "logloss_ceiling"]
    assert all(c["passed"] for c in d["checks"])
    assert check(d, "auc_floor")["threshold"] == 0.6 and check(d, "logloss_ceiling")["threshold"] == 0.75
    assert d["policy"] == to_dict(POLICY)
    json.dumps(d)  # stored as a JSON artifact


def test_first_run_thresholds_are_inclusive():
    assert decide(POLICY, first_run(0.6, 0.75))["passed"] is True


def test_first_run_fails_below_the_auc_floor():
    d = decide(POLICY, first_run(0.59, 0.5))
    assert d["passed"] is False and d["first_run"] is True
    assert check(d, "auc_floor")["passed"] is False and check(d, "logloss_ceiling")["passed"] is True


def test_first_run_fails_above_the_logloss_ceiling():
    d = decide(POLICY, first_run(0.9, 0.7501))
    assert d["passed"] is False
    assert check(d, "auc_floor")["passed"] is True and check(d, "logloss_ceiling")["passed"] is False


def test_first_run_with_missing_metrics_fails():
    d = decide(POLICY, first_run(None, None))  # e.g. a single-class holdout
    assert d["passed"] is False and not any(c["passed"] for c in d["checks"])


# ----------------------------------------------------------------------------- non-inferiority
def test_non_inferiority_passes_at_exactly_champion_minus_tolerance():
    champ = 0.71
    floor = champ - POLICY.auc_tolerance
    d = decide(POLICY, vs_champion(floor, champ))
    assert d["passed"] is True and d["first_run"] is False and d["champion_version"] == "3"
    c = check(d, "auc_non_inferiority")
    assert [x["name"] for x in d["checks"]] == ["auc_non_inferiority"]
    assert c["threshold"] == floor and c["value"] == floor and "v3" in c["reason"]


def test_non_inferiority_fails_just_below_the_floor():
    champ = 0.71
    floor = champ - POLICY.auc_tolerance
    d = decide(POLICY, vs_champion(float(np.nextafter(floor, 0.0)), champ))
    assert d["passed"] is False
    assert check(d, "auc_non_inferiority")["passed"] is False


def test_non_inferiority_ignores_the_first_run_thresholds():
    # below the absolute floor, but as good as the champion: passes
    assert decide(POLICY, vs_champion(0.55, 0.55))["passed"] is True
    # better than the floor, but clearly worse than the champion: fails
    assert decide(POLICY, vs_champion(0.70, 0.80))["passed"] is False


@pytest.mark.parametrize("cand,champ", [(None, 0.7), (0.7, None)])
def test_non_inferiority_with_a_missing_auc_fails(cand, champ):
    assert decide(POLICY, vs_champion(cand, champ))["passed"] is False


def test_zero_tolerance_requires_at_least_the_champion_auc():
    strict = GatePolicy(auc_tolerance=0.0)
    assert decide(strict, vs_champion(0.7, 0.7))["passed"] is True
    assert decide(strict, vs_champion(0.6999, 0.7))["passed"] is False


# ----------------------------------------------------------------------------- table
def _row(table: str, name: str) -> str:
    return next(line for line in table.splitlines() if line.startswith(name))


def test_format_table_rows_and_verdict_on_rejection():
    d = decide(POLICY, first_run(0.7, 0.9))
    t = format_table(d)
    lines = t.splitlines()
    assert lines[0].startswith("gate REJECTED") and "first run" in lines[0]
    assert lines[1].split()[:4] == ["check", "value", "threshold", "result"]
    assert "PASS" in _row(t, "auc_floor").split() and "0.70000" in _row(t, "auc_floor")
    assert "FAIL" in _row(t, "logloss_ceiling").split() and "0.90000" in _row(t, "logloss_ceiling")
    assert len(lines) == 2 + len(d["checks"])


def test_format_table_on_pass_against_a_champion():
    d = decide(POLICY, vs_champion(0.72, 0.71, version="5"))
    t = format_table(d)
    assert t.splitlines()[0] == "gate PASSED"
    row = _row(t, "auc_non_inferiority")
    assert "PASS" in row.split() and "FAIL" not in row and "v5" in row


def test_format_table_renders_missing_values():
    t = format_table(decide(POLICY, vs_champion(None, 0.7)))
    row = _row(t, "auc_non_inferiority")
    assert "None" in row and "FAIL" in row.split()


# ----------------------------------------------------------------------------- base compatibility
def test_base_compatibility_passes_only_on_equal_fingerprints():
    ok = decide(POLICY, vs_champion(0.8, 0.8), base={"candidate": "a" * 64, "serving": "a" * 64})
    assert ok["passed"] and check(ok, "base_compatible")["passed"]
    bad = decide(POLICY, vs_champion(0.9, 0.8), base={"candidate": "a" * 64, "serving": "b" * 64})
    assert not bad["passed"] and not check(bad, "base_compatible")["passed"]
    assert check(bad, "auc_non_inferiority")["passed"], "only the base check may fail here"


def test_missing_serving_base_fails_the_base_check():
    d = decide(POLICY, first_run(0.8, 0.5), base={"candidate": "a" * 64, "serving": None})
    assert not d["passed"] and not check(d, "base_compatible")["passed"]
