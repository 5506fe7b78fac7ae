"""Stage: validate lake partitions against the click-log suite before anything trains on them.

Unreadable input (missing or empty partition, an object that is not parquet, files that disagree on
schema) is a validation failure too, reported with the same typed error as a failed expectation.
A passing partition gets a `_validation.json` marker next to it.
"""
from __future__ import annotations

import datetime as dt
import logging

from pipelines.config import PipelineConfig
from pipelines.data.lake import Lake
from pipelines.errors import DataValidationError, LakeError

log = logging.getLogger(__name__)


def validate_partition(cfg: PipelineConfig, lake: Lake, day: str, where: str | None = None) -> dict:
    from pipelines.validation.suite import validate_frame

    where = where or lake.partition_uri(day)
    try:
        part = lake.read_location(where, day)
    except LakeError as exc:
        return {"where": where, "success": False, "rows": 0,
                "failures": [{"check": "readable_partition", "observed": str(exc), "expected": "readable parquet"}]}
    report = validate_frame(part.frame, cfg.validation, cfg.data.slots, where=where)
    report["sha256"] = part.sha256
    return report


def validate_uri(cfg: PipelineConfig, data_uri: str) -> dict:
    """Validate one partition given by its own URI (`.../dt=YYYY-MM-DD` or any directory of parquet)."""
    data_uri = data_uri.rstrip("/")
    leaf = data_uri.rpartition("/")[2]
    report = validate_partition(cfg, Lake(data_uri), leaf[3:] if leaf.startswith("dt=") else "-", where=data_uri)
    if not report["success"]:
        raise DataValidationError(data_uri, report["failures"])
    return report


def validate_window(cfg: PipelineConfig, lake_uri: str, end_day: str, days: int) -> dict:
    """Validate every partition in (end_day - days, end_day]; the run's own day must exist.

    Raises DataValidationError listing the failures of every bad partition (all are checked, so one
    run reports everything that is wrong, not just the first problem).
    """
    lake = Lake(lake_uri)
    start = dt.date.fromisoformat(end_day) - dt.timedelta(days=days - 1)
    present = [d for d in lake.list_partitions() if start <= dt.date.fromisoformat(d) <= dt.date.fromisoformat(end_day)]
    wanted = sorted(set(present) | {end_day})
    reports, failures = [], []
    for day in wanted:
        r = validate_partition(cfg, lake, day)
        reports.append({"dt": day, "success": r["success"], "rows": r.get("rows", 0), "failures": len(r["failures"])})
        for w in r.get("warnings", []):
            log.warning("WARN %s @ dt=%s: %s vs %s", w["check"], day, w.get("observed"), w.get("expected"))
        for f in r["failures"]:
            failures.append({**f, "check": f"{f['check']} @ dt={day}"})
        if r["success"]:
            lake.write_marker(day, "validation", {"suite": r.get("suite"), "gx_version": r.get("gx_version"),
                                                  "rows": r["rows"], "sha256": r.get("sha256"), "success": True})
    summary = {"lake": lake_uri, "end_day": end_day, "partitions": len(wanted), "rows": sum(r["rows"] for r in reports),
               "failed_partitions": [r["dt"] for r in reports if not r["success"]], "success": not failures}
    log.info("validated %d partitions (%d rows) of %s ending %s: %s", summary["partitions"], summary["rows"],
             lake_uri, end_day, "OK" if not failures else f"{len(failures)} failed checks")
    if failures:
        raise DataValidationError(f"{lake_uri} window ending {end_day}", failures)
    return summary
