"""What `validate` writes to the task log: one verdict table for the window (check, result, worst figure,
threshold, partitions) and the few most drifted features, never a line per warning; a missing figure says
what was missing. Every figure stays in the reports (the marker, the HTML report, reports/validation.json)."""

from __future__ import annotations

import logging

from pipelines.data.lake import Lake
from pipelines.data.synthetic import write_days
from pipelines.validation.stage import validate_window
from pipelines.validation.verdicts import TOP_DRIFTED, window_table
from tests.pipelines.validation.healthy_window import DAY, ROWS, SPEC, WINDOW, config

SCREEN = 40


def summary(success=True, warnings=0, partitions=2) -> dict:
    return {
        "lake": "s3://ctr-lake/clicks",
        "partitions": partitions,
        "end_day": "1998-03-07",
        "rows": 1234,
        "success": success,
        "warnings": warnings,
        "report": "s3://ctr-lake/clicks/dt=1998-03-07/validation_report.html",
    }


def test_a_clean_windows_log_is_one_table_on_one_screen(lake, caplog):
    write_days(Lake(str(lake)), SPEC, DAY, 1, ROWS)
    with caplog.at_level(logging.INFO, logger="pipelines.validation.stage"):
        validate_window(config(str(lake)), str(lake), DAY, WINDOW)
    (record,) = [r for r in caplog.records if r.name == "pipelines.validation.stage"]
    lines = record.getMessage().splitlines()
    assert len(lines) <= SCREEN and record.levelno == logging.INFO
    assert (
        lines[0].startswith(f"validation of {lake}, {WINDOW} partitions ending {DAY}")
        and "PASSED, 0 warnings" in lines[0]
    )
    assert lines[1].split() == ["check", "result", "figure", "(worst)", "threshold", "partitions"]
    assert lines[2].split()[-4:] == ["PASS", str(WINDOW), "of", str(WINDOW)]
    assert lines[-2].startswith("most drifted: drift_psi(") and lines[-1].startswith("every figure: ")


def test_warnings_over_many_features_and_days_are_one_row_with_the_worst_figure():
    drift = [{"check": f"drift_psi(f{i})", "observed": i / 1000, "expected": "psi <= 0.25"} for i in range(300)]
    reports = [
        {
            "dt": day,
            "evaluated": 400,
            "failures": [],
            "warnings": [{**w, "observed": w["observed"] * k} for w in drift],
            "drift": {"checks": [{**w, "observed": w["observed"] * k, "passed": False} for w in drift]},
        }
        for k, day in ((1, "1998-03-06"), (2, "1998-03-07"))
    ]
    reports[1]["warnings"].append(
        {
            "check": "label_rate_vs_reference(afternoon)",
            "observed": None,
            "expected": "within +/-30% of the reference label rate",
        }
    )
    text = window_table(reports, summary(warnings=601))
    lines = text.splitlines()
    assert len(lines) <= SCREEN
    rows = {line.split("  ")[0]: line for line in lines[2:-2]}
    assert rows["drift_psi (per feature)"].split()[3:] == ["WARN", "0.598", "psi", "<=", "0.25", "2", "of", "2"]
    assert "no rows of slot afternoon" in rows["label_rate_vs_reference(afternoon)"] and "None" not in text
    assert lines[-2].count("drift_psi(") == TOP_DRIFTED and lines[-2].startswith(
        "most drifted: drift_psi(f299) 0.598 (dt=1998-03-07)"
    )


def test_a_failed_check_comes_first_and_a_figure_that_was_not_measured_says_so():
    reports = [
        {
            "dt": "1998-03-07",
            "evaluated": 50,
            "warnings": [],
            "failures": [
                {"check": "stuck_column[category] @ dt=1998-03-07", "observed": None, "expected": "p >= 1e-7"}
            ],
        },
        {
            "dt": "1998-03-06",
            "evaluated": 50,
            "failures": [],
            "warnings": [
                {
                    "check": "expect_table_columns_to_match_set",
                    "observed": ["extra"],
                    "expected": "no columns outside the contract",
                }
            ],
        },
    ]
    lines = window_table(reports, summary(success=False, warnings=1)).splitlines()
    assert "FAILED, 1 warnings" in lines[0]
    assert lines[2].split()[:4] == ["stuck_column[category]", "FAIL", "not", "measured"]
    assert lines[3].startswith("expect_table_columns_to_match_set") and " WARN " in lines[3]
    assert lines[4].split()[:5] == ["98", "other", "check", "results", "PASS"]
