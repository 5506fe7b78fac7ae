"""The HTML validation page and the one-line summary (pure string building; no GX needed)."""

from __future__ import annotations

import copy
from html.parser import HTMLParser

import pytest

from pipelines.validation.report import render_html, summary_line

EVIL = "<script>alert('x')</script>"

FULL = {
    "where": "s3://ctr-lake/clicks/dt=1998-03-02",
    "dt": "1998-03-02",
    "success": False,
    "rows": 12345,
    "suite": "click_log_contract",
    "gx_version": "1.24.1",
    "evaluated": 42,
    "validated_at": "2026-11-29T23:00:00+00:00",
    "failures": [
        {
            "check": "expect_column_values_to_be_in_set(slot)",
            "observed": {"unexpected_count": 3, "unexpected_percent": 0.02, "sample": ["x", EVIL]},
            "expected": "slot in ['feed', 'search']",
        },
        {
            "check": "expect_column_values_to_not_be_null(user_id)",
            "observed": {"unexpected_count": 9},
            "expected": "no nulls",
        },
    ],
    "warnings": [
        {"check": "expect_column_mean_to_be_between(label)", "observed": 0.0, "expected": "label rate in [0.01, 0.9]"}
    ],
    "drift": {
        "checks": [
            {"check": "drift_psi(slot)", "observed": 0.31, "expected": "<= 0.2", "passed": False},
            {"check": "drift_psi(hour)", "observed": 0.01, "expected": "<= 0.2", "passed": True},
        ],
        "unseen": {"user_rate": 0.12, "item_rate": 0.03, "rows": 12345},
    },
    "reference": {"partitions": ["1998-02-23", "1998-02-24", "1998-03-01"], "rows": 50000},
    "quarantined": True,
}
PASSING = {"where": "s3://ctr-lake/clicks/dt=1998-03-03", "success": True, "rows": 500, "failures": [], "warnings": []}


class _Collector(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)

    def handle_data(self, data):
        self.text.append(data)


def parse(page: str) -> _Collector:
    p = _Collector()
    p.feed(page)
    p.close()
    return p


def test_full_report_renders_every_section():
    page = render_html(FULL)
    p = parse(page)
    assert p.tags.count("h1") == 1
    assert "script" not in p.tags and "link" not in p.tags  # self-contained: no JS, no external CSS
    text = " ".join(p.text)
    for f in FULL["failures"]:
        assert f["check"] in text
    assert "expect_column_mean_to_be_between(label)" in text
    assert "s3://ctr-lake/clicks/dt=1998-03-02" in text and "12,345" in text
    assert "click_log_contract" in text and "1.24.1" in text and "2026-11-29T23:00:00+00:00" in text
    assert "quarantined" in text
    assert "psi" in text and "slot" in text and "fail" in text
    assert "12.0%" in text and "3.0%" in text and "not a failure" in text
    assert "3 partitions" in text and "1998-02-23 .. 1998-03-01" in text and "50,000" in text
    assert "http://" not in page and "https://" not in page


@pytest.mark.parametrize(
    "report, badge",
    [
        (PASSING, "PASSED"),
        (FULL, "FAILED"),
        ({**PASSING, "warnings": FULL["warnings"]}, "PASSED WITH WARNINGS"),
        (
            {**PASSING, "drift": {"checks": [{"check": "drift_psi(slot)", "observed": 0.5, "passed": False}]}},
            "PASSED WITH WARNINGS",
        ),
    ],
)
def test_badge(report, badge):
    p = parse(render_html(report))
    h1 = p.text[p.text.index("Click-log validation ") :]
    assert h1[1] == badge


def test_user_controlled_values_are_escaped():
    report = copy.deepcopy(FULL)
    report["where"] = f"s3://bucket/{EVIL}"
    report["dt"] = EVIL
    report["suite"] = EVIL
    report["failures"][0]["check"] = f"expect_column_values_to_be_in_set({EVIL})"
    report["failures"][1]["observed"] = EVIL
    report["warnings"][0]["expected"] = EVIL
    report["drift"]["checks"][0]["check"] = f"drift_psi({EVIL})"
    report["reference"]["partitions"] = [EVIL]
    page = render_html(report)
    assert "<script" not in page.lower()
    assert "&lt;script&gt;" in page
    p = parse(page)
    assert "script" not in p.tags and p.tags.count("h1") == 1
    assert f"expect_column_values_to_be_in_set({EVIL})" in " ".join(p.text)  # escaped, not dropped


def test_nested_observed_is_compact_and_truncated():
    report = {
        **PASSING,
        "success": False,
        "failures": [
            {"check": "c(x)", "observed": {"sample": ["y" * 30] * 20, "n": [1, {"a": None}]}, "expected": "e"}
        ],
    }
    text = " ".join(parse(render_html(report)).text)
    assert '{"sample":["yyyy' in text
    assert "chars)" in text and "y" * 600 not in text


@pytest.mark.parametrize(
    "report",
    [
        {"where": "w", "success": True, "rows": 0},
        {
            "where": "w",
            "success": False,
            "rows": None,
            "failures": None,
            "warnings": None,
            "drift": None,
            "reference": None,
            "quarantined": None,
            "suite": None,
            "gx_version": None,
            "validated_at": None,
        },
        {
            "where": "w",
            "success": True,
            "rows": 1,
            "drift": {"checks": None, "unseen": None},
            "reference": {"partitions": [], "rows": None},
        },
        {
            "where": "w",
            "success": True,
            "rows": 1,
            "drift": {"unseen": {"user_rate": None}},
            "failures": [{"check": None}],
            "reference": {"partitions": ["1998-01-01"]},
        },
    ],
)
def test_missing_optional_keys(report):
    p = parse(render_html(report))
    assert p.tags.count("h1") == 1
    line = summary_line(report)
    assert "\n" not in line and line.split()[0] in {"PASSED", "FAILED"}


def test_summary_line_fail():
    assert summary_line(FULL) == (
        "FAILED s3://ctr-lake/clicks/dt=1998-03-02: 2 failed, 1 warning, 12,345 rows "
        "(drift: slot psi 0.31) [quarantined]"
    )


def test_summary_line_pass():
    assert summary_line(PASSING) == "PASSED s3://ctr-lake/clicks/dt=1998-03-03: 0 failed, 0 warnings, 500 rows"
    warned = {**PASSING, "warnings": FULL["warnings"] * 2}
    assert summary_line(warned).startswith(
        "PASSED WITH WARNINGS s3://ctr-lake/clicks/dt=1998-03-03: 0 failed, 2 warnings, 500 rows"
    )


def test_summary_line_is_one_line():
    assert "\n" not in summary_line({**PASSING, "where": "a\nb\rc"})
