"""The click-log lake: `dt=YYYY-MM-DD/*.parquet` partitions under an s3:// prefix or a local directory.

S3 goes through boto3. The endpoint is whatever boto3 resolves (the standard `AWS_ENDPOINT_URL`
variable, `~/.aws/config`), or an explicit `endpoint_url` that the Airflow side takes from its AWS
connection; so the same code talks to AWS, MinIO or the embedded moto server.
"""
from __future__ import annotations

import datetime as dt
import hashlib
import io
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from pipelines.data import schema
from pipelines.errors import LakeError

_PART_RE = re.compile(r"dt=(\d{4}-\d{2}-\d{2})/?$")


def s3_client(endpoint_url: str | None = None):
    import boto3

    return boto3.client("s3", endpoint_url=endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or None)


def split_s3(uri: str) -> tuple[str, str]:
    rest = uri[len("s3://"):]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise LakeError(f"not an s3 URI with a bucket: {uri!r}")
    return bucket, key.strip("/")


@dataclass
class PartitionData:
    """One partition as read: the frame plus what lineage needs (object list and content hash)."""

    dt: str
    uri: str
    frame: pd.DataFrame
    sha256: str
    files: list[str]


class Lake:
    def __init__(self, uri: str, endpoint_url: str | None = None):
        self.uri = uri.rstrip("/")
        if self.uri.startswith("file://"):
            self.uri = self.uri[len("file://"):]
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
        target = f"{self.uri}/{rel}"
        if self.is_s3:
            return self._get(split_s3(target)[1])
        try:
            return Path(target).read_bytes()
        except OSError as exc:
            raise LakeError(f"cannot read {target}: {exc}") from exc

    def has_objects(self, day: str) -> bool:
        """Whether anything at all exists under the partition (data or markers)."""
        return bool(self._list(self.partition_uri(day)))

    def put_bytes(self, rel: str, payload: bytes) -> str:
        target = f"{self.uri}/{rel}"
        if self.is_s3:
            bucket, key = split_s3(target)
            try:
                self.client.put_object(Bucket=bucket, Key=key, Body=payload)
            except Exception as exc:
                raise LakeError(f"cannot write {target}: {exc}") from exc
        else:
            Path(target).parent.mkdir(parents=True, exist_ok=True)
            Path(target).write_bytes(payload)
        return target

    # ------------------------------------------------------------ partitions
    def list_partitions(self) -> list[str]:
        """Sorted partition dates present in the lake."""
        days = set()
        if self.is_s3:
            bucket, key = split_s3(self.uri)
            try:
                pages = self.client.get_paginator("list_objects_v2").paginate(
                    Bucket=bucket, Prefix=f"{key}/" if key else "", Delimiter="/")
                for page in pages:
                    for p in page.get("CommonPrefixes", []):
                        m = _PART_RE.search(p["Prefix"])
                        if m:
                            days.add(m.group(1))
            except Exception as exc:
                raise LakeError(f"cannot list partitions of {self.uri}: {exc}") from exc
        elif Path(self.uri).is_dir():
            for p in Path(self.uri).iterdir():
                m = _PART_RE.search(p.name)
                if m and p.is_dir():
                    days.add(m.group(1))
        return sorted(days)

    def write_partition(self, frame: pd.DataFrame, day: str, part: int = 0) -> str:
        """Write one parquet file of a partition; re-writing the same part replaces it (idempotent)."""
        table = schema.to_arrow(frame)
        buf = io.BytesIO()
        pq.write_table(table, buf, compression="zstd")
        return self.put_bytes(f"dt={day}/part-{part:05d}.parquet", buf.getvalue())

    def parquet_files(self, day: str) -> list[str]:
        return [k for k in self._list(self.partition_uri(day)) if k.endswith(".parquet")]

    def read_partition(self, day: str) -> PartitionData:
        """Read every parquet file of a partition. Unreadable input raises LakeError naming the object."""
        return self.read_location(self.partition_uri(day), day)

    def read_location(self, where: str, day: str = "-") -> PartitionData:
        """Read every parquet file under `where` (a partition, or any prefix/directory in this lake)."""
        files = [k for k in self._list(where) if k.endswith(".parquet")]
        if not files:
            raise LakeError(f"partition {where} is missing or has no .parquet files")
        digest = hashlib.sha256()
        tables = []
        for f in files:
            payload = self._get(f)
            digest.update(payload)
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
        """Partitions with dates in (end_day - days, end_day], oldest first (or [start_day, end_day])."""
        end = dt.date.fromisoformat(end_day)
        start = dt.date.fromisoformat(start_day) if start_day else end - dt.timedelta(days=days - 1)
        wanted = [d for d in self.list_partitions() if start <= dt.date.fromisoformat(d) <= end]
        return [self.read_partition(d) for d in wanted]

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
    return {"partitions": per, "sha256": combined, "first": min(per) if per else None,
            "last": max(per) if per else None, "count": len(per)}
