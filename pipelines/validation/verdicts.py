"""The verdict of one validation window as the task log shows it: one table (check, result, worst figure,
threshold, partitions) and the most drifted features, short enough for one screen. Every figure of every
partition stays in the report artifacts (reports/validation.json, the HTML report per partition)."""

from __future__ import annotations

import re
from typing import Any

TOP_DRIFTED = 5
_CELL = 44


def window_table(reports: list[dict], summary: dict) -> str:
    """The window's verdict: a heading, a row per check that failed or warned (grouped over partitions, the
    worst figure shown), one row for the checks that passed everywhere, and the top drifted features."""
    groups: dict[str, dict] = {}
    for r in reports:
        for result, entries in (("FAIL", r.get("failures") or []), ("WARN", r.get("warnings") or [])):
            for e in entries:
                _add(groups, e, result, r.get("dt"))
    rows = [
        [name, g["result"], _figure(name, g["worst"]), _text(g["expected"]), f"{len(g['days'])} of {len(reports)}"]
        for name, g in sorted(groups.items(), key=lambda kv: (kv[1]["result"] != "FAIL", kv[0]))
    ]
    evaluated = sum(int(r.get("evaluated") or 0) for r in reports)
    flagged = sum(len(r.get("failures") or []) + len(r.get("warnings") or []) for r in reports)
    rows.append(
        [f"{max(evaluated - flagged, 0)} other check results", "PASS", "", "", f"{len(reports)} of {len(reports)}"]
    )
    verdict = "PASSED" if summary["success"] else "FAILED"
    head = (
        f"validation of {summary['lake']}, {summary['partitions']} partitions ending {summary['end_day']} "
        f"({summary['rows']:,} rows): {verdict}, {summary['warnings']} warnings"
    )
    lines = [head, *_aligned([["check", "result", "figure (worst)", "threshold", "partitions"], *rows])]
    drifted = _top_drifted(reports)
    if drifted:
        lines.append("most drifted: " + ", ".join(drifted))
    lines.append(f"every figure: {summary['report']} (and reports/validation.json on the MLflow run)")
    return "\n".join(lines)


def _add(groups: dict, entry: dict, result: str, day: Any) -> None:
    name = str(entry.get("check", "")).split(" @ dt=")[0]
    key = f"drift_{m.group(1)} (per feature)" if (m := re.fullmatch(r"drift_(\w+)\(.*\)", name)) else name
    g = groups.setdefault(key, {"result": result, "worst": None, "expected": entry.get("expected"), "days": set()})
    if result == "FAIL":
        g["result"] = "FAIL"
    g["days"].add(day)
    obs = entry.get("observed")
    if m and isinstance(obs, (int, float)):
        g["worst"] = max(g["worst"] or 0.0, float(obs))
    elif g["worst"] is None:
        g["worst"] = obs


def _figure(name: str, worst: Any) -> str:
    """The worst observed value in words: None says what was not there to measure."""
    if worst is None:
        slot = re.fullmatch(r"label_rate_vs_reference\((\w+)\)", name)
        if slot and slot.group(1) != "all":
            return f"no rows of slot {slot.group(1)}"
        return "not measured"
    return format(worst, ".3g") if isinstance(worst, float) else _text(worst)


def _top_drifted(reports: list[dict]) -> list[str]:
    """The TOP_DRIFTED features with the largest drift statistic over the window (passed or not)."""
    worst: dict[str, tuple[float, str]] = {}
    for r in reports:
        for c in (r.get("drift") or {}).get("checks") or []:
            obs = c.get("observed")
            if isinstance(obs, (int, float)) and (c["check"] not in worst or obs > worst[c["check"]][0]):
                worst[c["check"]] = (float(obs), str(r.get("dt")))
    top = sorted(worst.items(), key=lambda kv: -kv[1][0])[:TOP_DRIFTED]
    return [f"{check} {value:.3g} (dt={day})" for check, (value, day) in top]


def _text(v: Any) -> str:
    s = re.sub(r"[\x00-\x1f\x7f]", "?", "" if v is None else str(v))
    return s if len(s) <= _CELL else s[: _CELL - 1] + "…"


def _aligned(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
