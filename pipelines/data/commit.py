"""Partition commits: how the lake's writers make a day's data appear whole, or not at all.

A writer puts the parts of a new *generation* next to the partition's current ones (names carry the
generation, so nothing already committed is touched), then writes the manifest
`dt=DAY/_MANIFEST.json` last: generation, part names, their row counts, sizes and hashes, and the
partition's content hash. That one PUT (an atomic rename on a local disk) is the commit point:
readers read exactly the parts the manifest lists, so a writer killed mid-day leaves the previous
commit readable and unchanged, and its stray parts invisible. Only after the manifest is written are
the objects of earlier generations (and strays of killed writers) deleted; a failed delete raises.

Replacing a committed partition takes `overwrite=True`. One writer per partition at a time: a writer
that finds, at commit, that another one committed since it started refuses rather than clobber it.

The content hash is sha256 over the parts' bytes in manifest order: what `Lake.read_partition` hashes,
what lineage and the validation marker record.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import io
import json
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable

import pandas as pd
import pyarrow.parquet as pq

from pipelines.data import schema
from pipelines.errors import LakeError

if TYPE_CHECKING:
    from pipelines.data.lake import Lake

MANIFEST = "_MANIFEST.json"
FORMAT = "ctr-lake-manifest/1"
TMP_INFIX = ".tmp-"  # local writes go to `.<name>.tmp-<id>` first (Lake.put_bytes)


class PartitionExistsError(LakeError):
    """A committed partition would be replaced without `overwrite`."""

    def __init__(self, lake_uri: str, days: list[str]):
        self.days = days
        names = ", ".join(f"dt={d}" for d in days)
        super().__init__(
            f"{lake_uri} already has committed partition(s) {names}: refusing to replace them; "
            "pass overwrite=True (CLI: generate --overwrite) to write new ones, the old parts are "
            "kept until the new ones are committed"
        )


class UncommittedPartitionError(LakeError):
    """A partition holds objects but no manifest: a writer is still running or was killed mid-day."""

    def __init__(self, where: str):
        self.where = where
        super().__init__(
            f"partition {where} is not committed (no {MANIFEST}): its writer is still running, was "
            "killed mid-write, or wrote it before lake commits existed; re-run the writer "
            "(e.g. python -m pipelines generate ...) to commit it"
        )


@dataclass(frozen=True)
class Part:
    name: str  # object name inside the partition
    sha256: str
    bytes: int
    rows: int | None  # None for parts put as raw bytes (not parsed at write time)


@dataclass(frozen=True)
class Manifest:
    dt: str
    generation: str
    committed_at: str
    sha256: str  # the partition's content hash
    rows: int | None
    parts: tuple[Part, ...]

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "format": FORMAT,
                "dt": self.dt,
                "generation": self.generation,
                "committed_at": self.committed_at,
                "sha256": self.sha256,
                "rows": self.rows,
                "parts": [vars(p) for p in self.parts],
            },
            indent=2,
        ).encode()

    @classmethod
    def parse(cls, payload: bytes, where: str) -> "Manifest":
        """A manifest as read; anything but this format's JSON raises LakeError naming it."""
        try:
            raw = json.loads(payload)
            if raw.get("format") != FORMAT:
                raise ValueError(f"format {raw.get('format')!r}, expected {FORMAT!r}")
            parts = tuple(
                Part(
                    str(p["name"]), str(p["sha256"]), int(p["bytes"]), None if p.get("rows") is None else int(p["rows"])
                )
                for p in raw["parts"]
            )
            if not parts or any("/" in p.name or not p.name for p in parts):
                raise ValueError("no parts, or a part name that is not a plain object name")
            return cls(
                str(raw["dt"]),
                str(raw["generation"]),
                str(raw["committed_at"]),
                str(raw["sha256"]),
                None if raw.get("rows") is None else int(raw["rows"]),
                parts,
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise LakeError(f"{where}/{MANIFEST} is not a valid lake manifest: {exc}") from exc


def read_manifest(lake: "Lake", day: str) -> Manifest | None:
    payload = lake.get_bytes_if_exists(f"dt={day}/{MANIFEST}")
    return None if payload is None else Manifest.parse(payload, lake.partition_uri(day))


def check_content(man: Manifest, sha256: str, where: str) -> None:
    """The bytes read must be the bytes committed: a part replaced after its commit fails the read."""
    if sha256 != man.sha256:
        raise LakeError(
            f"partition {where} changed after it was committed (generation {man.generation}): "
            f"its parts hash to {sha256[:12]}, the manifest says {man.sha256[:12]}; re-write it"
        )


def refuse_existing(lake: "Lake", days: list[str]) -> None:
    """PartitionExistsError naming every day of `days` already committed (one listing, before any write)."""
    existing = sorted(set(days) & set(lake.list_partitions()))
    if existing:
        raise PartitionExistsError(lake.uri, existing)


def new_generation() -> str:
    """Sortable by time for a reader of the listing, unique by the random tail."""
    return f"{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:8]}"


class PartitionWriter:
    """Stage the parts of one partition, then `commit()`; nothing is visible to readers before that."""

    def __init__(self, lake: "Lake", day: str, *, overwrite: bool = False):
        try:
            dt.date.fromisoformat(day)
        except (TypeError, ValueError) as exc:  # a malformed day would name a prefix no reader looks at
            raise LakeError(f"not a partition day YYYY-MM-DD: {day!r}") from exc
        self.lake, self.day = lake, day
        self.previous = read_manifest(lake, day)
        if self.previous is not None and not overwrite:
            raise PartitionExistsError(lake.uri, [day])
        self.generation = new_generation()
        self.parts: list[Part] = []
        self._digest = hashlib.sha256()
        self.committed: Manifest | None = None

    def write_frame(self, frame: pd.DataFrame) -> str:
        """One part from contract rows (conformed to the parquet schema of the contract)."""
        buf = io.BytesIO()
        pq.write_table(schema.to_arrow(frame), buf, compression="zstd")
        return self.put_part(buf.getvalue(), rows=len(frame))

    def put_part(self, payload: bytes, rows: int | None = None) -> str:
        """One part as given bytes (e.g. parquet produced elsewhere): not parsed, validation judges it."""
        if self.committed is not None:
            raise LakeError(f"{self.lake.partition_uri(self.day)}: generation {self.generation} is already committed")
        name = f"part-{len(self.parts):05d}-{self.generation}.parquet"
        uri = self.lake.put_bytes(f"dt={self.day}/{name}", payload)
        self.parts.append(Part(name, hashlib.sha256(payload).hexdigest(), len(payload), rows))
        self._digest.update(payload)
        return uri

    def commit(self) -> Manifest:
        """Write the manifest (the commit point), then delete what no manifest lists any more."""
        where = self.lake.partition_uri(self.day)
        if not self.parts:
            raise LakeError(f"{where}: nothing to commit (no parts written)")
        current = read_manifest(self.lake, self.day)
        if (current and current.generation) != (self.previous and self.previous.generation):
            raise LakeError(
                f"{where} was committed by another writer (generation {current and current.generation}) "
                f"while generation {self.generation} was being written; re-run one writer at a time"
            )
        rows = None if any(p.rows is None for p in self.parts) else sum(p.rows for p in self.parts)
        man = Manifest(
            self.day,
            self.generation,
            dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            self._digest.hexdigest(),
            rows,
            tuple(self.parts),
        )
        self.lake.put_bytes(f"dt={self.day}/{MANIFEST}", man.to_json())
        self.committed = man
        remove_unlisted(self.lake, self.day, man)
        return man

    def abandon(self) -> None:
        """Delete this writer's own parts after a failure before its commit (never listed by a manifest)."""
        if self.committed is None and self.parts:
            self.lake.delete([self.lake.key_of(f"dt={self.day}/{p.name}") for p in self.parts])


def remove_unlisted(lake: "Lake", day: str, man: Manifest) -> list[str]:
    """Delete the partition's part files (and interrupted local writes) that `man` does not list: earlier
    generations and strays of killed writers. Markers and reports stay. Returns what was deleted."""
    keep = {lake.key_of(f"dt={day}/{p.name}") for p in man.parts}
    stale = [
        k for k in lake.objects(day) if k not in keep and (k.endswith(".parquet") or TMP_INFIX in k.rsplit("/", 1)[-1])
    ]
    if stale:
        lake.delete(stale)
    return stale


def write_frames(
    lake: "Lake",
    day: str,
    frames: Iterable[pd.DataFrame],
    *,
    overwrite: bool = False,
    on_part: Callable[[pd.DataFrame], None] | None = None,
) -> Manifest:
    """Write `frames` (one part each) as partition `day` and commit them. A failure before the commit
    leaves the partition as it was and removes this writer's parts; a kill leaves them for the next commit."""
    writer = PartitionWriter(lake, day, overwrite=overwrite)
    try:
        for frame in frames:
            writer.write_frame(frame)
            if on_part is not None:
                on_part(frame)
        return writer.commit()
    except BaseException:
        if writer.committed is None:
            try:
                writer.abandon()
            except LakeError:
                pass  # the original error matters more; the next commit removes these parts
        raise
