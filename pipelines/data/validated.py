"""What training, evaluation and cold start may read: committed partitions whose validation marker says
`passed` for the content they hold now.

The marker `dt=DAY/_validation.json` is written by the validation stage (`validation.stage.record`,
the DAGs' validate task): status `passed` or `quarantined` and the sha256 of the content it judged.
A day never validated, quarantined, or re-written since (its content hash changed) is refused with
the list of every such day of the window: data nobody checked never reaches a model.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from pipelines.errors import DataValidationError, LakeError

if TYPE_CHECKING:
    from pipelines.data.commit import Manifest
    from pipelines.data.lake import Lake, PartitionData

MARKER = "validation"  # dt=DAY/_validation.json


class UnvalidatedPartitionError(DataValidationError):
    """Partitions a reader was asked for are not validated as they are now; `failures` names each day."""

    def __init__(self, lake_uri: str, failures: list[dict]):
        super().__init__(f"{lake_uri} (training data)", failures)
        self.args = (
            self.args[0] + "\nValidate these days first (validation.stage.validate_window: the DAGs' "
            "validate task, or the CLI's train-base / train-adapter / cold-start, which validate their "
            "window before training). A quarantined day must be fixed upstream, re-written with "
            "--overwrite and validated again.",
        )


def read_marker(lake: "Lake", day: str) -> dict | None:
    """The day's validation marker; None when it has none. An unreadable or corrupt marker raises."""
    payload = lake.get_bytes_if_exists(f"dt={day}/_{MARKER}.json")
    if payload is None:
        return None
    try:
        marker = json.loads(payload)
    except ValueError as exc:
        raise LakeError(f"{lake.partition_uri(day)}/_{MARKER}.json is not JSON: {exc}") from exc
    if not isinstance(marker, dict):
        raise LakeError(f"{lake.partition_uri(day)}/_{MARKER}.json is not a JSON object")
    return marker


def problem(lake: "Lake", day: str, sha256: str) -> str | None:
    """Why `day` (content hash `sha256`) may not be trained on, or None when its marker passed that content."""
    try:
        marker = read_marker(lake, day)
    except LakeError as exc:
        return f"validation marker unreadable: {exc}"
    if marker is None:
        return "no validation marker (never validated)"
    if marker.get("status") != "passed":
        return f"validation status {marker.get('status')!r}, not 'passed'"
    if marker.get("sha256") != sha256:
        return (
            f"re-written since it was validated (marker sha256 {str(marker.get('sha256'))[:12]}, "
            f"partition {sha256[:12]})"
        )
    return None


def require_validated(lake: "Lake", hashes: dict[str, str]) -> None:
    """UnvalidatedPartitionError listing every day of `hashes` (day -> content sha256) not passed as is."""
    failures = []
    for day, sha in sorted(hashes.items()):
        why = problem(lake, day, sha)
        if why is not None:
            failures.append(
                {
                    "check": f"validated_partition @ dt={day}",
                    "observed": why,
                    "expected": f"marker _{MARKER}.json with status 'passed' for sha256 {sha[:12]}",
                }
            )
    if failures:
        raise UnvalidatedPartitionError(lake.uri, failures)


def validated_manifests(lake: "Lake", end_day: str, days: int, start_day: str | None = None) -> dict[str, "Manifest"]:
    """The manifests of the window's committed days (`Lake.window`), oldest first, after refusing (before
    any data is read) every day not validated as committed."""
    window = lake.window(end_day, days, start_day)
    manifests = {d: lake.manifest(d) for d in window}
    gone = [d for d, m in manifests.items() if m is None]
    if gone:  # committed at listing time, no manifest now: being re-written right now
        raise LakeError(f"partitions {gone} of {lake.uri} lost their manifest while being read; re-run")
    require_validated(lake, {d: m.sha256 for d, m in manifests.items()})
    return manifests


def read_validated_window(lake: "Lake", end_day: str, days: int, start_day: str | None = None) -> list["PartitionData"]:
    """`Lake.read_window`, refusing a day not validated as committed, and any day whose committed
    content changed while it was being read (the bytes read are checked against the manifest)."""
    manifests = validated_manifests(lake, end_day, days, start_day)
    parts = [lake.read_partition(d) for d in manifests]
    changed = [p.dt for p in parts if p.sha256 != manifests[p.dt].sha256]
    if changed:
        raise LakeError(f"partitions {changed} of {lake.uri} were re-written while being read; re-run")
    return parts
