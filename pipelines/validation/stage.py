"""Stage: validate lake partitions before anything trains on them.

Per partition: read it (unreadable input is a failure like any other), run the GX suite with the
partition's day and the reference window (the trailing *validated* partitions), measure drift and
the unseen-id rate against that reference, then record the outcome next to the partition:

- `_validation.json`: status `passed` or `quarantined`, suite version, content hash, the report;
- `_validation_report.html`: the human-readable report.

The data itself is never deleted or rewritten. A partition already validated under the same suite
version with the same content hash is not validated again.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections import OrderedDict
from pathlib import Path

import mlflow
import pandas as pd

from pipelines.config import PipelineConfig
from pipelines.data.lake import Lake, PartitionData
from pipelines.data.validated import MARKER
from pipelines.errors import DataValidationError, LakeError
from pipelines.registry import mlflow_io, runs
from pipelines.validation import consistency
from pipelines.validation.consistency import consistency_checks
from pipelines.validation.drift import drift_checks, profile
from pipelines.validation.report import render_html, summary_line
from pipelines.validation.suite import suite_version, validate_frame
from pipelines.validation.verdicts import window_table

log = logging.getLogger(__name__)

_SCHEMA_CHECKS = (
    "expect_column_to_exist",
    "expect_column_values_to_be_of_type",
    "expect_column_values_to_be_in_type_list",
)
REPORT_HTML = "_validation_report.html"  # the marker's name (MARKER) is data.validated's: training reads it


def reference_stats(frames: list[pd.DataFrame], partitions: list[str]) -> dict | None:
    """What the relative checks and drift need from the reference window (None: no reference yet)."""
    if not frames:
        return None
    ref = pd.concat([f[["label", "slot"]] for f in frames], ignore_index=True)
    by_slot = ref.groupby("slot", observed=True)["label"].agg(["mean", "size"])
    return {
        "partitions": len(partitions),
        "dates": partitions,
        "rows": int(len(ref)),
        "label_rate": float(ref["label"].mean()),
        "label_rate_by_slot": {str(k): float(r["mean"]) for k, r in by_slot.iterrows()},
        "rows_by_slot": {str(k): int(r["size"]) for k, r in by_slot.iterrows()},
        "profile": profile(frames),
        "consistency": consistency.reference(frames),
    }


def check_partition(cfg: PipelineConfig, part: PartitionData, reference: dict | None) -> dict:
    """GX suite + drift for one readable partition; a JSON-safe report."""
    v = cfg.validation
    ref_public = (
        None
        if reference is None
        else {k: reference[k] for k in ("partitions", "rows", "label_rate", "label_rate_by_slot", "rows_by_slot")}
    )
    report = validate_frame(
        part.frame, v, cfg.data.slots, where=part.uri, day=None if part.dt == "-" else part.dt, reference=ref_public
    )
    report.update(
        dt=part.dt,
        sha256=part.sha256,
        drift=None,
        reference=None if reference is None else {"partitions": reference["dates"], "rows": reference["rows"]},
    )
    # Drift and consistency read columns as their contract types: not run once the suite found one missing or mistyped.
    if reference is not None and not any(f["check"].startswith(_SCHEMA_CHECKS) for f in report["failures"]):
        drift = drift_checks(
            part.frame, reference["profile"], psi_max=v.drift_psi_max, numeric_psi_max=v.drift_numeric_psi_max
        )
        report["drift"] = drift
        # Drift measured on a few hundred rows is mostly sampling noise: below drift_min_rows it warns.
        judged = len(part.frame) >= v.drift_min_rows and v.drift_action == "fail"
        target = report["failures"] if judged else report["warnings"]
        target += [{k: c[k] for k in ("check", "observed", "expected")} for c in drift["checks"] if not c["passed"]]
        report["success"] = not report["failures"]
    if not any(f["check"].startswith(_SCHEMA_CHECKS) for f in report["failures"]):
        report["consistency"] = _consistency(cfg, part.frame, reference)
        report["failures"] += [
            {k: c[k] for k in ("check", "observed", "expected")} for c in report["consistency"] if not c["passed"]
        ]
        report["success"] = not report["failures"]
    return report


def _consistency(cfg: PipelineConfig, frame: pd.DataFrame, reference: dict | None) -> list[dict]:
    v = cfg.validation
    return consistency_checks(
        frame,
        None if reference is None else reference["consistency"],
        slots=cfg.data.slots,
        max_item_category_mismatch=v.max_item_category_mismatch,
        max_replayed_fraction=v.max_replayed_fraction,
        stuck_column_p=v.stuck_column_p,
        max_single_column_auc=v.max_single_column_auc,
        leak_min_rows=v.label_leak_min_rows,
    )


def unreadable_report(where: str, day: str, exc: Exception) -> dict:
    return {
        "where": where,
        "dt": day,
        "success": False,
        "rows": 0,
        "warnings": [],
        "drift": None,
        "failures": [{"check": "readable_partition", "observed": str(exc), "expected": "readable, non-empty parquet"}],
    }


def record(lake: Lake, day: str, report: dict, suite_version: str) -> dict:
    """Write the marker and the HTML report next to the partition; returns their URIs."""
    report["quarantined"] = not report["success"]
    report["validated_at"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    marker = {
        "status": "passed" if report["success"] else "quarantined",
        "suite_version": suite_version,
        "sha256": report.get("sha256"),
        "validated_at": report["validated_at"],
        "report": report,
    }
    html_uri = lake.put_bytes(f"dt={day}/{REPORT_HTML}", render_html(report).encode())
    marker_uri = lake.write_marker(day, MARKER, marker)
    return {"marker": marker_uri, "html": html_uri}


def read_marker(lake: Lake, day: str) -> dict | None:
    try:
        return json.loads(lake.get_bytes(f"dt={day}/_{MARKER}.json"))
    except LakeError:
        return None


def _trim(validated: OrderedDict[str, pd.DataFrame], keep: int) -> None:
    """Drop the oldest partitions of the reference window until at most `keep` remain."""
    while len(validated) > keep:
        validated.popitem(last=False)


def _seed_reference(lake: Lake, present: list[str], start: dt.date, keep: int) -> OrderedDict[str, pd.DataFrame]:
    """The reference before the window: the last `keep` readable `passed` partitions before `start`
    (looked for among the 4 x `keep` partitions before it), oldest first."""
    before = [d for d in present if dt.date.fromisoformat(d) < start][-4 * keep :]
    validated: OrderedDict[str, pd.DataFrame] = OrderedDict()
    for d in before:
        m = read_marker(lake, d)
        if m and m.get("status") == "passed":
            try:
                validated[d] = lake.read_partition(d).frame
            except LakeError:
                continue
    _trim(validated, keep)
    return validated


def _validate_day(
    cfg: PipelineConfig, lake: Lake, day: str, version: str, validated: OrderedDict[str, pd.DataFrame]
) -> dict:
    """The report of one partition of the window, judged against `validated` (the reference) and recorded;
    a partition that passes joins the reference of the days after it."""
    fresh = True
    try:
        part = lake.read_partition(day)
    except LakeError as exc:
        report, part = unreadable_report(lake.partition_uri(day), day, exc), None
    else:
        marker = read_marker(lake, day)
        if (
            marker
            and marker.get("status") == "passed"
            and marker.get("suite_version") == version
            and marker.get("sha256") == part.sha256
        ):
            report, fresh = marker["report"], False  # same data, same checks: the earlier verdict stands
        else:
            ref = reference_stats(list(validated.values()), list(validated)) if validated else None
            report = check_partition(cfg, part, ref)
    if fresh and lake.has_objects(day):  # a missing partition gets no marker (nothing to quarantine)
        record(lake, day, report, version)
    if report["success"] and part is not None:
        validated[day] = part.frame
        _trim(validated, cfg.validation.reference_partitions)
    else:
        log.error("%s (report: %s)", summary_line(report), lake.partition_uri(day) + "/" + REPORT_HTML)
    return report


def validate_window(cfg: PipelineConfig, lake_uri: str, end_day: str, days: int, log_to_mlflow: bool = False) -> dict:
    """Validate every partition in (end_day - days, end_day], oldest first; the run's own day must exist.

    Each partition is judged against the `reference_partitions` validated partitions before it.
    Raises DataValidationError listing the failures of every bad partition (all are checked, so one
    run reports everything that is wrong, not just the first problem).
    """
    lake, v = Lake(lake_uri), cfg.validation
    version = suite_version(v, cfg.data.slots)
    end = dt.date.fromisoformat(end_day)
    start = end - dt.timedelta(days=days - 1)
    present = lake.list_partitions()
    wanted = sorted({d for d in present if start <= dt.date.fromisoformat(d) <= end} | {end_day})
    # Seed the reference with the validated partitions just before the window.
    validated = _seed_reference(lake, present, start, v.reference_partitions)

    reports, failures, warnings = [], [], []
    for day in wanted:
        report = _validate_day(cfg, lake, day, version, validated)
        reports.append(report)
        failures += [{**f, "check": f"{f['check']} @ dt={day}"} for f in report["failures"]]
        warnings += [{**w, "check": f"{w['check']} @ dt={day}"} for w in report.get("warnings", [])]

    newest = reports[-1]
    summary = {
        "lake": lake_uri,
        "end_day": end_day,
        "partitions": len(wanted),
        "rows": sum(r.get("rows", 0) for r in reports),
        "failed_partitions": [r["dt"] for r in reports if not r["success"]],
        "warnings": len(warnings),
        "success": not failures,
        "suite_version": version,
        "unseen": (newest.get("drift") or {}).get("unseen"),
        "report": lake.partition_uri(end_day) + "/" + REPORT_HTML,
    }
    # one table, not a line per warning: a clean day's log fits one screen (every figure is in the reports)
    level = logging.ERROR if failures else logging.WARNING if warnings else logging.INFO
    log.log(level, "%s", window_table(reports, summary))
    if log_to_mlflow:
        _log_to_mlflow(cfg, summary, reports)
    if failures:
        raise DataValidationError(f"{lake_uri} window ending {end_day}", failures)
    return summary


def _log_to_mlflow(cfg: PipelineConfig, summary: dict, reports: list[dict]) -> None:
    """One run per validation in the `ctr-data-validation` experiment: summary metrics + every report."""
    exp = mlflow_io.ensure_experiment("ctr-data-validation")
    with runs.start_run(exp, f"validate-{summary['end_day']}", nested=mlflow.active_run() is not None):
        mlflow.set_tags(
            {
                "lake": summary["lake"],
                "end_day": summary["end_day"],
                "success": str(summary["success"]),
                "suite_version": summary["suite_version"],
            }
        )
        mlflow.log_metrics(
            {
                "partitions": summary["partitions"],
                "rows": summary["rows"],
                "failed_partitions": len(summary["failed_partitions"]),
                "warnings": summary["warnings"],
            }
        )
        if summary.get("unseen"):
            mlflow.log_metrics({f"unseen_{k}": float(x) for k, x in summary["unseen"].items() if k != "rows"})
        for r in reports:
            mlflow.log_text(render_html(r), f"reports/dt={r['dt']}/validation_report.html")
        mlflow.log_dict({"summary": summary, "reports": reports}, "reports/validation.json")


def validate_uri(
    cfg: PipelineConfig, data_uri: str, reference_uris: list[str] | None = None, report_dir: str | None = None
) -> dict:
    """Validate one partition given by its own URI (`.../dt=YYYY-MM-DD` or any directory of parquet),
    against the given reference partitions. Writes report.html/report.json to `report_dir` if given."""
    data_uri = data_uri.rstrip("/")
    leaf = data_uri.rpartition("/")[2]
    day = leaf[3:] if leaf.startswith("dt=") else "-"
    try:
        part = Lake(data_uri).read_location(data_uri, day)
        refs = [Lake(u).read_location(u.rstrip("/"), "ref") for u in reference_uris or []]
        reference = reference_stats([r.frame for r in refs], [r.uri for r in refs])
        report = check_partition(cfg, part, reference)
    except LakeError as exc:
        report = unreadable_report(data_uri, day, exc)
    if report_dir:
        Path(report_dir).mkdir(parents=True, exist_ok=True)
        (Path(report_dir) / "report.html").write_text(render_html(report))
        (Path(report_dir) / "report.json").write_text(json.dumps(report, indent=2, default=str))
    if not report["success"]:
        raise DataValidationError(data_uri, report["failures"])
    return report
