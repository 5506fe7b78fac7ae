"""No false alarms: the real validation stage (`validate_window`, real Great Expectations, the
production-like thresholds of configs/synthetic.yaml) on the healthy window of synthetic days must
not cry wolf: a clean next day, a mildly shifted day, side nulls within budget, a re-run and a fixed
partition all pass, and a quarantined day never becomes reference.

The bad inputs themselves are test_bad_input_corpus.py; the window and helpers are healthy_window.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pipelines.config import REPO_ROOT, load_pipeline_config
from pipelines.data import schema
from pipelines.data.lake import Lake
from pipelines.data.synthetic import SyntheticSpec, write_days
from pipelines.errors import DataValidationError
from pipelines.validation.stage import REPORT_HTML, read_marker, validate_window
from tests.pipelines.validation.healthy_window import (
    DAY,
    HEALTHY,
    ROWS,
    SPEC,
    WINDOW,
    assign_some,
    config,
    failed_checks,
    mtimes,
    objects,
    put_frame,
    registry_state,
    synthetic,
)


def passes(lake_uri: str, day: str = DAY, days: int = WINDOW) -> dict:
    summary = validate_window(config(lake_uri), lake_uri, day, days)
    assert summary["success"] and summary["failed_partitions"] == []
    assert read_marker(Lake(lake_uri), day)["status"] == "passed"
    return summary


def test_clean_next_day_passes(lake, registry):
    write_days(Lake(str(lake)), SPEC, DAY, 1, ROWS)
    summary = passes(str(lake))
    assert summary["partitions"] == WINDOW and summary["rows"] == WINDOW * ROWS
    report = read_marker(Lake(str(lake)), DAY)["report"]
    assert report["reference"]["partitions"] == HEALTHY[-7:]  # reference_partitions: 7
    assert report["drift"]["checks"] and all(c["passed"] for c in report["drift"]["checks"])
    assert registry_state() == (["1"], "1", 1)


@pytest.mark.parametrize(
    "spec, slot_psi",
    [
        (dataclasses.replace(SPEC, slot_mix=(0.55, 0.33, 0.12)), (0.001, 0.1)),  # a mild, healthy move of the slot mix
        (dataclasses.replace(SPEC, slot_ctr=(0.038, 0.066, 0.016)), (0.0, 0.1)),  # CTRs moved by a few percent
    ],
    ids=["slot_mix_0.55_0.33_0.12", "slot_ctr_nudged"],
)
def test_mildly_shifted_healthy_day_passes(lake, spec, slot_psi):
    put_frame(Lake(str(lake)), DAY, schema.to_arrow(synthetic(DAY, spec=spec)))
    passes(str(lake))
    drift = {c["check"]: c["observed"] for c in read_marker(Lake(str(lake)), DAY)["report"]["drift"]["checks"]}
    assert slot_psi[0] <= drift["drift_psi(slot)"] < slot_psi[1]  # seen, but under drift_psi_max


def test_side_nulls_within_the_null_budget_pass(lake, healthy_next_day):
    put_frame(Lake(str(lake)), DAY, assign_some(healthy_next_day.copy(), "gender", 0.04, None))  # 4 % < 5 % allowed
    passes(str(lake))


def test_rerun_reuses_markers_and_still_passes(lake):
    write_days(Lake(str(lake)), SPEC, DAY, 1, ROWS)
    passes(str(lake))
    days = [*HEALTHY, DAY]
    stamp = mtimes(lake, days)
    content = {d: objects(Lake(str(lake)), d) for d in days}
    again = passes(str(lake))
    assert again["partitions"] == WINDOW
    assert mtimes(lake, days) == stamp  # nothing rewritten: not the markers, not the HTML reports
    assert {d: objects(Lake(str(lake)), d) for d in days} == content


def test_fixing_a_partition_lifts_its_quarantine(lake, healthy_next_day):
    lk = Lake(str(lake))
    put_frame(lk, DAY, healthy_next_day.assign(label=np.int8(0)))
    with pytest.raises(DataValidationError):
        validate_window(config(str(lake)), str(lake), DAY, WINDOW)
    assert read_marker(lk, DAY)["status"] == "quarantined"
    bad_html = lk.get_bytes(f"dt={DAY}/{REPORT_HTML}")

    # a re-run on the same bad bytes is quarantined again (a quarantined verdict is never reused as a pass)
    with pytest.raises(DataValidationError):
        validate_window(config(str(lake)), str(lake), DAY, WINDOW)

    write_days(lk, SPEC, DAY, 1, ROWS, overwrite=True)  # the upstream fix re-exports the day (generate --overwrite)
    passes(str(lake))
    marker = read_marker(lk, DAY)
    assert marker["report"]["failures"] == [] and marker["report"]["quarantined"] is False
    assert lk.get_bytes(f"dt={DAY}/{REPORT_HTML}") != bad_html


def test_quarantined_day_is_not_used_as_reference(lake, healthy_next_day):
    """The next day is judged against the validated days only, and the bad day keeps failing the window."""
    lk = Lake(str(lake))
    put_frame(lk, DAY, healthy_next_day.assign(label=np.int8(0)))
    write_days(lk, SPEC, "2026-06-10", 1, ROWS)
    with pytest.raises(DataValidationError) as info:
        validate_window(config(str(lake)), str(lake), "2026-06-10", WINDOW + 1)
    assert {c.rsplit(" @ ", 1)[1] for c in failed_checks(info.value)} == {f"dt={DAY}"}
    nxt = read_marker(lk, "2026-06-10")
    assert nxt["status"] == "passed"
    assert nxt["report"]["reference"]["partitions"] == HEALTHY[-7:]  # 2026-06-09 (quarantined) left out
    assert read_marker(lk, DAY)["status"] == "quarantined"


def test_no_false_alarms_over_a_month_of_small_healthy_days(tmp_path):
    """30 healthy days of 12,000 rows: the small splash slot (1.5% CTR on 10% of traffic) used to trip
    the relative label-rate band on a quarter of the days before the band was widened by its
    binomial standard error."""
    lake = Lake(str(tmp_path))
    write_days(lake, SyntheticSpec(seed=3), "2026-03-01", 30, 12_000)
    cfg = load_pipeline_config(
        REPO_ROOT / "configs" / "synthetic.yaml", overrides={"data": {"lake_uri": str(tmp_path)}}
    )
    summary = validate_window(cfg, str(tmp_path), "2026-03-30", 30)
    assert summary["success"] and summary["partitions"] == 30 and summary["failed_partitions"] == []
