"""A self-contained HTML page (and a one-line summary) for one partition's validation report.

The report is the JSON-safe dict built by `suite.validate_frame` plus the stage's extras (dt, drift,
reference, quarantined, validated_at). Only `where`, `success` and `rows` are guaranteed; everything
else may be missing or None. The page uses inline CSS only (no scripts, no external resources), so it
opens offline from an artifact store. Every value that came from data or config is HTML-escaped.
"""

from __future__ import annotations

import json
import re
from html import escape
from typing import Any

_MAX_CELL = 200  # characters of an observed value shown in a table cell

_CSS = """body{font:14px/1.45 system-ui,sans-serif;margin:2em;color:#222;max-width:1100px}
h1{font-size:1.4em;margin:0 0 .3em}h2{font-size:1.1em;margin:1.6em 0 .4em}
.badge{display:inline-block;padding:.2em .7em;border-radius:4px;color:#fff;font-weight:600}
.passed{background:#2e7d32}.failed{background:#c62828}.warned{background:#ef6c00}
.note{color:#c62828;font-weight:600;margin-left:.6em}
table{border-collapse:collapse;width:100%}th,td{border:1px solid #ddd;padding:.3em .5em;text-align:left;
vertical-align:top}th{background:#f4f4f4}td code{white-space:pre-wrap;word-break:break-all}
dl{display:grid;grid-template-columns:max-content auto;gap:.2em 1em}dt{color:#666}dd{margin:0}
.ok{color:#2e7d32}.bad{color:#c62828;font-weight:600}.muted{color:#777}"""


def _text(v: Any, limit: int = _MAX_CELL) -> str:
    """A compact, unescaped rendering: strings as-is, anything else as compact JSON, truncated."""
    if isinstance(v, str):
        s = v
    else:
        try:
            s = json.dumps(v, separators=(",", ":"), ensure_ascii=False, default=str)
        except (TypeError, ValueError):  # e.g. a circular structure
            s = repr(v)
    return s if len(s) <= limit else s[:limit] + f"…({len(s)} chars)"


def _e(v: Any, limit: int = _MAX_CELL) -> str:
    return escape(_text(v, limit), quote=True)


def _list(report: dict, key: str) -> list[dict]:
    return [x for x in (report.get(key) or []) if isinstance(x, dict)]


def _drift_checks(report: dict) -> list[dict]:
    drift = report.get("drift")
    return _list(drift, "checks") if isinstance(drift, dict) else []


def _split_check(name: Any) -> tuple[str, str]:
    """'drift_psi(slot)' -> ('slot', 'psi'); anything else -> (name, '')."""
    m = re.fullmatch(r"(?:drift_)?(\w+)\((.*)\)", str(name or ""))
    return (m.group(2), m.group(1)) if m else (str(name or ""), "")


def _status(report: dict) -> tuple[str, str]:
    if not report.get("success"):
        return "FAILED", "failed"
    if _list(report, "warnings") or any(c.get("passed") is False for c in _drift_checks(report)):
        return "PASSED WITH WARNINGS", "warned"
    return "PASSED", "passed"


def _num(v: Any, fmt: str) -> str:
    return format(v, fmt) if isinstance(v, int | float) and not isinstance(v, bool) else "n/a"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _table(headers: list[str], rows: list[list[str]], empty: str) -> str:
    if not rows:
        return f'<p class="muted">{escape(empty)}</p>'
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _check_rows(checks: list[dict]) -> list[list[str]]:
    return [
        [f"<code>{_e(c.get('check'))}</code>", f"<code>{_e(c.get('observed'))}</code>", _e(c.get("expected"))]
        for c in checks
    ]


def render_html(report: dict) -> str:
    """The whole page as one HTML string (UTF-8, inline CSS, no scripts)."""
    label, css = _status(report)
    where = report.get("where")
    note = '<span class="note">quarantined</span>' if report.get("quarantined") else ""
    meta = [
        ("Partition", f"<code>{_e(where, 1000)}</code>"),
        ("dt", _e(report.get("dt") or "n/a")),
        ("Rows", _num(report.get("rows"), ",")),
        ("Suite", f"{_e(report.get('suite') or 'n/a')} (GX {_e(report.get('gx_version') or 'n/a')})"),
        ("Checks evaluated", _num(report.get("evaluated"), ",")),
        ("Validated at", _e(report.get("validated_at") or "n/a")),
    ]
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{escape(label)}: {_e(where, 300)}</title><style>{_CSS}</style></head><body>",
        f'<h1>Click-log validation <span class="badge {css}">{escape(label)}</span>{note}</h1>',
        "<dl>" + "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in meta) + "</dl>",
        "<h2>Failed checks</h2>",
        _table(["check", "observed", "expected"], _check_rows(_list(report, "failures")), "No failed checks."),
        "<h2>Warnings</h2>",
        _table(["check", "observed", "expected"], _check_rows(_list(report, "warnings")), "No warnings."),
        "<h2>Drift vs reference</h2>",
    ]
    drift_rows = []
    for c in _drift_checks(report):
        col, stat = _split_check(c.get("check"))
        passed = c.get("passed")
        verdict = (
            '<span class="ok">pass</span>'
            if passed
            else '<span class="bad">fail</span>'
            if passed is False
            else '<span class="muted">n/a</span>'
        )
        drift_rows.append(
            [_e(col), _e(stat or "n/a"), f"<code>{_e(c.get('observed'))}</code>", _e(c.get("expected")), verdict]
        )
    out.append(_table(["column", "statistic", "value", "threshold", "result"], drift_rows, "No drift checks."))
    drift = report.get("drift") if isinstance(report.get("drift"), dict) else {}
    unseen = drift.get("unseen") if isinstance(drift.get("unseen"), dict) else None
    if unseen:
        out.append(
            "<p>New users / new items vs reference — feeds cold start, not a failure: "
            f"<b>{_num(unseen.get('user_rate'), '.1%')}</b> new users, "
            f"<b>{_num(unseen.get('item_rate'), '.1%')}</b> new items"
            f" (of {_num(unseen.get('rows'), ',')} rows).</p>"
        )
    out.append("<h2>Reference window</h2>")
    ref = report.get("reference") if isinstance(report.get("reference"), dict) else {}
    parts = sorted(str(p) for p in (ref.get("partitions") or []))
    if parts:
        out.append(
            f"<p>{_plural(len(parts), 'partition')}: {_e(parts[0])} .. {_e(parts[-1])}"
            f" ({_num(ref.get('rows'), ',')} rows).</p>"
        )
    else:
        out.append('<p class="muted">No reference window.</p>')
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def summary_line(report: dict) -> str:
    """One line for task logs, e.g. 'FAILED s3://…/dt=…: 2 failed, 1 warning, 12,345 rows (drift: slot psi 0.31)'."""
    label = _status(report)[0]
    where = re.sub(r"[\x00-\x1f\x7f]", "?", str(report.get("where")))
    rows = report.get("rows")
    line = (
        f"{label} {where}: {len(_list(report, 'failures'))} failed, "
        f"{_plural(len(_list(report, 'warnings')), 'warning')}, {_num(rows, ',')} rows"
    )
    drifted = [c for c in _drift_checks(report) if c.get("passed") is False]
    if drifted:
        bits = []
        for c in drifted:
            col, stat = _split_check(c.get("check"))
            obs = c.get("observed")
            val = format(obs, ".3g") if isinstance(obs, float) else _text(obs, 40)
            bits.append(re.sub(r"[\x00-\x1f\x7f]", "?", f"{col} {stat} {val}".replace("  ", " ")))
        line += f" (drift: {', '.join(bits)})"
    return line + (" [quarantined]" if report.get("quarantined") else "")
