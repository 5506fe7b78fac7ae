"""The healthy window the bad-input corpus and the no-false-alarm tests of the validation stage run on:
its constants, the synthetic rows, and helpers to write, list and compare lake objects.

Sizes: 20,000 rows a day. At the synthetic.yaml thresholds (label rate within +/-30 % of the reference
per slot once a slot has >= 500 rows) smaller days are too noisy: the splash slot (10 % of traffic,
~1.5 % CTR, so ~30 clicks a day at 20k rows) trips label_rate_vs_reference(splash) on roughly one
healthy day in six at 20k rows and one in four at 12k. The data is seeded and the dates fixed, so the
healthy days pass deterministically; at the CLI's default 100k rows/day no healthy day trips it.
"""

from __future__ import annotations

import datetime as dt
import io
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from mlflow import MlflowClient

from pipelines.config import REPO_ROOT, load_pipeline_config
from pipelines.data.commit import PartitionWriter
from pipelines.data.lake import Lake
from pipelines.data.synthetic import SyntheticSpec, generate_day
from pipelines.errors import DataValidationError
from pipelines.promotion import aliases
from pipelines.validation.stage import MARKER, REPORT_HTML

MODEL = "ctr_lora_feed"
ROWS = 20_000
FIRST, REF_DAYS = "2026-06-01", 8
HEALTHY = [(dt.date.fromisoformat(FIRST) + dt.timedelta(days=i)).isoformat() for i in range(REF_DAYS)]
DAY = "2026-06-09"  # the run's day: the partition that gets corrupted
WINDOW = REF_DAYS + 1  # validate_window covers the healthy days and the run's day
MARKER_JSON = f"_{MARKER}.json"
ADDED_BY_VALIDATION = {MARKER_JSON, REPORT_HTML}
SPEC = SyntheticSpec()


def config(lake_uri: str):
    return load_pipeline_config(REPO_ROOT / "configs" / "synthetic.yaml", overrides={"data": {"lake_uri": lake_uri}})


def synthetic(day: str, rows: int = ROWS, spec: SyntheticSpec = SPEC) -> pd.DataFrame:
    return pd.concat(list(generate_day(spec, day, rows)), ignore_index=True)


def registry_state() -> tuple[list[str], str | None, int]:
    """(versions of the model, @champion, number of alias moves), and nothing else registered (but the
    serving base the champion records)."""
    c = MlflowClient()
    assert sorted(m.name for m in c.search_registered_models()) == sorted([MODEL, "ctr_base"])
    versions = sorted(str(v.version) for v in c.search_model_versions(f"name='{MODEL}'"))
    return versions, aliases.current(MODEL), len(aliases.history(MODEL))


# ----------------------------------------------------------------------------- lake helpers
def parquet_bytes(frame: pd.DataFrame | pa.Table) -> bytes:
    """Parquet of `frame` as it is: no contract conform, so wrong dtypes and extra columns survive."""
    table = frame if isinstance(frame, pa.Table) else pa.Table.from_pandas(frame, preserve_index=False)
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


def put_frame(lk: Lake, day: str, *frames) -> None:
    """The frames as they are (`parquet_bytes`), one part each, committed as the day's partition."""
    put_parts(lk, day, *(parquet_bytes(f) for f in frames))


def put_parts(lk: Lake, day: str, *payloads: bytes) -> None:
    """Bytes committed as the day's part files, unparsed: what an upstream writer delivered, good or bad."""
    writer = PartitionWriter(lk, day)
    for payload in payloads:
        writer.put_part(payload)
    writer.commit()


def objects(lk: Lake, day: str) -> dict[str, bytes]:
    """Every object under the partition: name relative to the partition -> bytes."""
    prefix = lk.partition_uri(day)
    if lk.is_s3:
        bucket, key = prefix[len("s3://") :].split("/", 1)
        pages = lk.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key + "/")
        keys = [o["Key"] for p in pages for o in p.get("Contents", [])]
        return {k[len(key) + 1 :]: lk.client.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys}
    root = Path(prefix)
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()} if root.is_dir() else {}


def mtimes(root: Path, days: list[str]) -> dict[str, int]:
    return {
        str(p.relative_to(root)): p.stat().st_mtime_ns
        for d in days
        for p in (root / f"dt={d}").rglob("*")
        if p.is_file()
    }


def failed_checks(exc: DataValidationError) -> list[str]:
    return [f["check"] for f in exc.failures]


# ----------------------------------------------------------------------------- row edits
def rows_mask(frame: pd.DataFrame, fraction: float, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).random(len(frame)) < fraction


def assign_some(frame: pd.DataFrame, col: str, fraction: float, value, dtype=None) -> pd.DataFrame:
    s = frame[col].astype(dtype) if dtype else frame[col]
    frame[col] = s.mask(rows_mask(frame, fraction), value)
    return frame
