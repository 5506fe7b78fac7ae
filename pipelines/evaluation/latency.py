"""Serving latency of a loaded pyfunc: p50 / p99 per batch size, measured after warm-up.

Measured in the evaluation task on holdout rows, one call at a time (what one serving worker does).
The numbers depend on the worker's hardware and load: the gate's latency budget is meant to catch an
adapter that is an order of magnitude slower (a wrong target module, a huge rank), not 5 %.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pandas as pd

from pipelines.registry.model_input import model_input


def pyfunc_latency(model, rows: pd.DataFrame, batch_sizes=(1, 32), warmup: int = 5, repeats: int = 50) -> dict:
    """{"batch_<n>": {"p50_ms", "p99_ms", "calls"}} for each batch size (rows are cycled when short)."""
    if len(rows) == 0:
        return {}
    rows = model_input(model, rows)  # time what serving sends: the signature's columns, nothing more
    out = {}
    for n in batch_sizes:
        reps = -(-n // len(rows))
        batch = pd.concat([rows] * reps, ignore_index=True).head(n) if reps > 1 else rows.head(n)
        for _ in range(warmup):
            model.predict(batch)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            model.predict(batch)
            times.append((time.perf_counter() - t0) * 1e3)
        out[f"batch_{n}"] = {
            "p50_ms": float(np.percentile(times, 50)),
            "p99_ms": float(np.percentile(times, 99)),
            "calls": repeats,
        }
    return out


def directory_bytes(directory: str | Path) -> int:
    """Bytes of every file under `directory` (the adapter's size as stored)."""
    return int(sum(p.stat().st_size for p in Path(directory).rglob("*") if p.is_file()))
