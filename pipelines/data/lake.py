"""The click-log lake: `dt=YYYY-MM-DD` partitions under an s3:// prefix or a local directory.

A partition is what its manifest (`dt=DAY/_MANIFEST.json`, see `data.commit`) lists: part files of
one generation, committed together. Readers read exactly those parts and treat a partition without a
manifest as absent, so a writer still running, or killed mid-day, is never half read.

S3 goes through boto3. The endpoint is whatever boto3 resolves (the standard `AWS_ENDPOINT_URL`
variable, `~/.aws/config`), or an explicit `endpoint_url` that the Airflow side takes from its AWS
connection; so the same code talks to AWS, MinIO or the embedded moto server. Every client retries
transient S3 errors (`s3_config`); what still fails after that raises LakeError.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import io
import json
import logging
import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

import boto3
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from botocore.config import Config

from pipelines.data import commit
from pipelines.errors import LakeError

log = logging.getLogger(__name__)

_PART_RE = re.compile(r"dt=(\d{4}-\d{2}-\d{2})/?$")
_KEY_RE = re.compile(r"^dt=(\d{4}-\d{2}-\d{2})/(.+)$")  # an object of a partition, relative to the lake


# botocore's standard retry mode retries throttling, 500/502/503/504 and connection errors (refused,
# reset, timed out) with truncated exponential backoff and full jitter, within a per-client retry
# quota (botocore/retries/standard.py). Since botocore 1.44 a non-throttling error waits
# rand(0, 1) * min(0.05 s * 2**(attempt-1), 20 s): early retries catch a blip at once, and only the
# later ones wait long. 14 attempts ride out a MinIO or S3 endpoint restart of ~20 s (expected total
# wait ~53 s, at most ~105 s; with 12, one request in ~11 gave up inside a 20 s outage, by simulating
# the waits) before LakeError; longer outages are for the Airflow task's retries.
S3_MAX_ATTEMPTS = 14
S3_CONNECT_TIMEOUT_S = 10  # a blackholed endpoint costs 10 s an attempt, not botocore's 60


def s3_config():
    """The botocore Config of every S3 client the library creates: standard retry mode, total attempts
    from `AWS_MAX_ATTEMPTS` (botocore's own variable, here so an operator can tune it) else
    S3_MAX_ATTEMPTS. An explicit retry config also shields us from `AWS_RETRY_MODE=legacy`/`adaptive`."""
    raw = os.environ.get("AWS_MAX_ATTEMPTS") or str(S3_MAX_ATTEMPTS)
    try:
        attempts = int(raw)
    except ValueError:
        attempts = 0
    if attempts < 1:
        raise LakeError(f"AWS_MAX_ATTEMPTS={raw!r}: must be a whole number of attempts, 1 or more")
    return Config(retries={"mode": "standard", "total_max_attempts": attempts}, connect_timeout=S3_CONNECT_TIMEOUT_S)


def s3_client(endpoint_url: str | None = None):
    return boto3.client(
        "s3", endpoint_url=endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or None, config=s3_config()
    )


def split_s3(uri: str) -> tuple[str, str]:
    rest = uri[len("s3://") :]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise LakeError(f"not an s3 URI with a bucket: {uri!r}")
    return bucket, key.strip("/")


def _missing(exc: Exception) -> bool:
    """Whether a botocore error says the object does not exist (as opposed to: cannot be reached)."""
    # `response` is None on some botocore errors (a body cut off mid-read): that is "cannot be read".
    code = str((getattr(exc, "response", None) or {}).get("Error", {}).get("Code", ""))
    return code in ("NoSuchKey", "404", "NotFound")


@dataclass
class PartitionData:
    """One partition as read: the frame plus what lineage needs (object list and content hash)."""

    dt: str
    uri: str
    frame: pd.DataFrame
    sha256: str
    files: list[str]
    generation: str | None = None  # the committed generation read (None: a plain directory of parquet)


class Lake:
    def __init__(self, uri: str, endpoint_url: str | None = None):
        self.uri = uri.rstrip("/")
        if self.uri.startswith("file://"):
            self.uri = self.uri[len("file://") :]
        self.is_s3 = self.uri.startswith("s3://")
        self._endpoint_url = endpoint_url
        self._client = None

    # ------------------------------------------------------------ low level
    @property
    def client(self):
        if self._client is None:
            self._client = s3_client(self._endpoint_url)
        return self._client

    def partition_uri(self, day: str) -> str:
        return f"{self.uri}/dt={day}"

    def key_of(self, rel: str) -> str:
        """The object key (s3) or path (local) of `<lake>/<rel>`, as `_list` returns them."""
        target = f"{self.uri}/{rel}"
        return split_s3(target)[1] if self.is_s3 else target

    def _list(self, prefix_uri: str) -> list[str]:
        """Keys (s3) or paths (local) of the objects directly or indirectly under prefix_uri."""
        if self.is_s3:
            bucket, key = split_s3(prefix_uri)
            out: list[str] = []
            try:
                for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key + "/"):
                    out.extend(o["Key"] for o in page.get("Contents", []))
            except Exception as exc:  # botocore errors: no such bucket, endpoint down, access denied
                raise LakeError(f"cannot list {prefix_uri}: {exc}") from exc
            return sorted(out)
        root = Path(prefix_uri)
        return sorted(str(p) for p in root.rglob("*") if p.is_file()) if root.is_dir() else []

    def _get(self, key_or_path: str) -> bytes:
        if self.is_s3:
            bucket, _ = split_s3(self.uri)
            try:
                return self.client.get_object(Bucket=bucket, Key=key_or_path)["Body"].read()
            except Exception as exc:
                raise LakeError(f"cannot read s3://{bucket}/{key_or_path}: {exc}") from exc
        try:
            return Path(key_or_path).read_bytes()
        except OSError as exc:
            raise LakeError(f"cannot read {key_or_path}: {exc}") from exc

    def get_bytes(self, rel: str) -> bytes:
        """Bytes of the object at `<lake>/<rel>`; LakeError if it does not exist or cannot be read."""
        return self._get(self.key_of(rel))

    def get_bytes_if_exists(self, rel: str) -> bytes | None:
        """Bytes of `<lake>/<rel>`, None when there is no such object; LakeError when it cannot be read."""
        if self.is_s3:
            bucket, key = split_s3(f"{self.uri}/{rel}")
            try:
                return self.client.get_object(Bucket=bucket, Key=key)["Body"].read()
            except Exception as exc:
                if _missing(exc):
                    return None
                raise LakeError(f"cannot read s3://{bucket}/{key}: {exc}") from exc
        try:
            return Path(f"{self.uri}/{rel}").read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise LakeError(f"cannot read {self.uri}/{rel}: {exc}") from exc

    def objects(self, day: str) -> list[str]:
        """Keys (paths) of every object under the partition: committed or not, data or markers."""
        return self._list(self.partition_uri(day))

    def has_objects(self, day: str) -> bool:
        """Whether anything at all exists under the partition (data, markers, or uncommitted parts)."""
        return bool(self.objects(day))

    def put_bytes(self, rel: str, payload: bytes) -> str:
        """Write `<lake>/<rel>` whole: an S3 PUT is atomic; a local file is written aside and renamed, so
        a process killed mid-write never leaves a truncated object under the real name."""
        target = f"{self.uri}/{rel}"
        if self.is_s3:
            bucket, key = split_s3(target)
            try:
                self.client.put_object(Bucket=bucket, Key=key, Body=payload)
            except Exception as exc:
                raise LakeError(f"cannot write {target}: {exc}") from exc
            return target
        path = Path(target)
        tmp = path.with_name(f".{path.name}{commit.TMP_INFIX}{uuid.uuid4().hex[:8]}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as fh:
                fh.write(payload)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise LakeError(f"cannot write {target}: {exc}") from exc
        return target

    def delete(self, keys: list[str]) -> None:
        """Delete objects (keys or paths as `_list` returns them). Every object that could not be deleted
        raises, named: S3 answers a batch delete with 200 and lists per-key failures in `Errors`."""
        failed: list[str] = []
        if self.is_s3:
            bucket, _ = split_s3(self.uri)
            for i in range(0, len(keys), 1000):
                batch = keys[i : i + 1000]
                try:
                    resp = self.client.delete_objects(
                        Bucket=bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}
                    )
                except Exception as exc:  # botocore errors: the whole batch failed
                    failed += [f"{k} ({exc})" for k in batch]
                    continue
                failed += [f"{e.get('Key')} ({e.get('Code')}: {e.get('Message')})" for e in resp.get("Errors", [])]
        else:
            for k in keys:
                try:
                    Path(k).unlink()
                except FileNotFoundError:
                    continue  # already gone: what deleting it was for
                except OSError as exc:
                    failed.append(f"{k} ({exc})")
        if failed:
            raise LakeError(
                f"could not delete {len(failed)} of {len(keys)} objects in {self.uri}: " + "; ".join(failed)
            )

    # ------------------------------------------------------------ partitions
    def _scan(self) -> tuple[set[str], set[str]]:
        """(days with any object, days with a manifest): one listing of the lake's `dt=` objects."""
        present, committed = set(), set()
        if self.is_s3:
            bucket, key = split_s3(self.uri)
            base = f"{key}/" if key else ""
            try:
                for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=base + "dt="):
                    for o in page.get("Contents", []):
                        m = _KEY_RE.match(o["Key"][len(base) :])
                        if m:
                            present.add(m.group(1))
                            if m.group(2) == commit.MANIFEST:
                                committed.add(m.group(1))
            except Exception as exc:
                raise LakeError(f"cannot list partitions of {self.uri}: {exc}") from exc
        elif Path(self.uri).is_dir():
            for p in Path(self.uri).iterdir():
                m = _PART_RE.search(p.name)
                if m and p.is_dir():
                    present.add(m.group(1))
                    if (p / commit.MANIFEST).is_file():
                        committed.add(m.group(1))
        return present, committed

    def list_partitions(self) -> list[str]:
        """Sorted dates of the committed partitions (uncommitted ones are absent to readers)."""
        return sorted(self._scan()[1])

    def uncommitted_partitions(self) -> list[str]:
        """Sorted dates that hold objects but no manifest: a writer still running or killed mid-day."""
        present, committed = self._scan()
        return sorted(present - committed)

    def window(self, end_day: str, days: int, start_day: str | None = None) -> list[str]:
        """Committed dates in (end_day - days, end_day] (or [start_day, end_day]), oldest first. An
        uncommitted date in the range is skipped, and logged so that a gap in the data is visible."""
        end = dt.date.fromisoformat(end_day)
        start = dt.date.fromisoformat(start_day) if start_day else end - dt.timedelta(days=days - 1)
        present, committed = self._scan()
        inside = sorted(d for d in present if start <= dt.date.fromisoformat(d) <= end)
        for d in inside:
            if d not in committed:
                log.warning(
                    "%s has objects but no %s (a writer is running or was killed): read as absent; "
                    "re-run its writer to commit it",
                    self.partition_uri(d),
                    commit.MANIFEST,
                )
        return [d for d in inside if d in committed]

    def manifest(self, day: str) -> commit.Manifest | None:
        """The partition's committed manifest, None when it has none (absent or uncommitted)."""
        return commit.read_manifest(self, day)

    def write_partition(self, frame: pd.DataFrame, day: str, *, overwrite: bool = False) -> str:
        """Write `frame` as the whole partition `day` (one part) and commit it; returns the manifest's URI.

        An existing committed partition is replaced only with `overwrite=True` (else PartitionExistsError),
        and its parts are deleted only once the new manifest is written. Several parts: `commit.write_frames`.
        """
        commit.write_frames(self, day, [frame], overwrite=overwrite)
        return f"{self.partition_uri(day)}/{commit.MANIFEST}"

    def parquet_files(self, day: str) -> list[str]:
        """Keys (paths) of the committed parts of `day`, in order; [] when it is not committed."""
        man = self.manifest(day)
        return [] if man is None else [self.key_of(f"dt={day}/{p.name}") for p in man.parts]

    def read_partition(self, day: str) -> PartitionData:
        """Read the committed parts of a partition. Missing, uncommitted, changed-since-commit or unreadable
        input raises LakeError naming the partition or the object."""
        man = self.manifest(day)
        where = self.partition_uri(day)
        if man is None:
            if self.has_objects(day):
                raise commit.UncommittedPartitionError(where)
            raise LakeError(f"partition {where} is missing (no objects)")
        return self._read_committed(where, f"dt={day}", day, man)

    def read_location(self, where: str, day: str = "-") -> PartitionData:
        """Read a committed partition's parts when `where` holds a manifest, else every parquet file under
        `where` (any directory or prefix of parquet, e.g. an export checked before it is loaded)."""
        where = where.rstrip("/")
        rel = where[len(self.uri) :].strip("/")
        payload = self.get_bytes_if_exists(f"{rel}/{commit.MANIFEST}" if rel else commit.MANIFEST)
        if payload is None:
            return self._read_files(where, day, [k for k in self._list(where) if k.endswith(".parquet")])
        return self._read_committed(where, rel, day, commit.Manifest.parse(payload, where))

    def _read_committed(self, where: str, rel: str, day: str, man: commit.Manifest) -> PartitionData:
        """The parts `man` lists, each checked against its committed hash before it is parsed."""
        files = [self.key_of(f"{rel}/{p.name}" if rel else p.name) for p in man.parts]
        part = self._read_files(where, day, files, [p.sha256 for p in man.parts])
        commit.check_content(man, part.sha256, where)
        part.generation = man.generation
        return part

    def _read_files(self, where: str, day: str, files: list[str], expected: list[str] | None = None) -> PartitionData:
        if not files:
            raise LakeError(f"partition {where} is missing or has no .parquet files")
        digest = hashlib.sha256()
        tables = []
        for i, f in enumerate(files):
            payload = self._get(f)
            digest.update(payload)
            if expected is not None and hashlib.sha256(payload).hexdigest() != expected[i]:
                raise LakeError(
                    f"object {f} of {where} changed after it was committed: its bytes are not "
                    "the ones its manifest lists; re-write the partition"
                )
            try:
                tables.append(pq.read_table(io.BytesIO(payload)))
            except (pa.ArrowInvalid, OSError) as exc:
                raise LakeError(f"object {f} in {where} is not readable parquet: {exc}") from exc
        try:
            table = pa.concat_tables(tables, promote_options="none")
        except pa.ArrowInvalid as exc:
            raise LakeError(f"files of {where} disagree on schema: {exc}") from exc
        frame = table.to_pandas(types_mapper={pa.string(): pd.StringDtype()}.get)
        if frame.empty:
            raise LakeError(f"partition {where} is empty (0 rows)")
        return PartitionData(dt=day, uri=where, frame=frame, sha256=digest.hexdigest(), files=files)

    def read_window(self, end_day: str, days: int, start_day: str | None = None) -> list[PartitionData]:
        """Committed partitions with dates in (end_day - days, end_day], oldest first (or [start_day, end_day])."""
        return [self.read_partition(d) for d in self.window(end_day, days, start_day)]

    # ------------------------------------------------------------ markers
    def write_marker(self, day: str, name: str, payload: dict) -> str:
        return self.put_bytes(f"dt={day}/_{name}.json", json.dumps(payload, indent=2, default=str).encode())


def concat(parts: list[PartitionData]) -> pd.DataFrame:
    if not parts:
        raise LakeError("no partitions to read in the requested window")
    return pd.concat([p.frame for p in parts], ignore_index=True)


def lineage(parts: list[PartitionData]) -> dict:
    """Compact lineage of a set of partitions: dates, per-partition hashes and one combined hash."""
    per = {p.dt: p.sha256 for p in parts}
    combined = hashlib.sha256(json.dumps(per, sort_keys=True).encode()).hexdigest()
    return {
        "partitions": per,
        "sha256": combined,
        "first": min(per) if per else None,
        "last": max(per) if per else None,
        "count": len(per),
    }
