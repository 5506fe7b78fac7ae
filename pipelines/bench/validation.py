"""The validation-stage benchmark (`python -m pipelines bench validation`, and a row of `make bench`):
wall time of validating one synthetic day against a reference window of validated days, the work the
`validate` stage does for each arriving partition. Goal: under 10 s for 1,000,000 rows.

Measured (``validate_s``): read the partition, compute the reference statistics of the window, run
the Great Expectations suite (absolute and reference-relative checks) and the drift checks (PSI per
column, unseen-id rates), and write the validation markers. Not in it: generating and writing the
synthetic days (reported apart, ``generate_and_write_all_days_s``) and building the GX context, which
one untimed call on the first day builds and caches beforehand.
"""

from __future__ import annotations

import tempfile
import time

from pipelines.config import REPO_ROOT, load_pipeline_config
from pipelines.data import synthetic
from pipelines.data.lake import Lake
from pipelines.validation.stage import check_partition, record, reference_stats
from pipelines.validation.suite import suite_version


def bench_validation(rows: int = 1_000_000, reference_days: int = 7) -> dict:
    """Validate one synthetic day of `rows` rows against `reference_days` validated days of the same
    size: read + GX suite (absolute and reference-relative checks) + drift + unseen ids + markers."""
    cfg = load_pipeline_config(REPO_ROOT / "configs" / "synthetic.yaml")
    spec = synthetic.SyntheticSpec(seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        lake = Lake(tmp)
        t = time.perf_counter()
        days = synthetic.write_days(lake, spec, "2026-01-01", reference_days + 1, rows)
        gen_s = time.perf_counter() - t
        ref_frames = [lake.read_partition(d).frame for d in days[:-1]]
        check_partition(cfg, lake.read_partition(days[0]), None)  # builds and caches the GX context
        t = time.perf_counter()
        part = lake.read_partition(days[-1])
        ref = reference_stats(ref_frames, days[:-1])
        report = check_partition(cfg, part, ref)
        record(lake, days[-1], report, suite_version(cfg.validation, cfg.data.slots))
        val_s = time.perf_counter() - t
    return {
        "benchmark": "validate one synthetic day against a reference window (GX + drift + markers)",
        "rows": rows,
        "reference_rows": rows * reference_days,
        "generate_and_write_all_days_s": round(gen_s, 1),
        "validate_s": round(val_s, 2),
        "target_s": 10,
        "expectations": report["evaluated"],
        "drift_checks": len((report.get("drift") or {}).get("checks", [])),
        "valid": report["success"],
    }
