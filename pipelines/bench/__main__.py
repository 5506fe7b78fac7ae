"""`python -m pipelines.bench [--write docs/benchmarks.md]`: measured numbers, never timed unit tests.

Each benchmark prints one JSON line; with --write, the results replace the generated section of the
benchmarks document (between the BEGIN/END markers), stamped with the machine and the command.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

BEGIN, END = "<!-- BEGIN make bench -->", "<!-- END make bench -->"


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def bench_validation(rows: int = 1_000_000, reference_days: int = 7) -> dict:
    """Validate one synthetic day of `rows` rows against `reference_days` validated days of the same
    size: read + GX suite (absolute and reference-relative checks) + drift + unseen ids + markers."""
    from pipelines.config import REPO_ROOT, load_pipeline_config
    from pipelines.data import synthetic
    from pipelines.data.lake import Lake
    from pipelines.validation.stage import check_partition, record, reference_stats
    from pipelines.validation.suite import suite_version

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
    return {"benchmark": "validate one synthetic day against a reference window (GX + drift + markers)",
            "rows": rows, "reference_rows": rows * reference_days, "generate_and_write_all_days_s": round(gen_s, 1),
            "validate_s": round(val_s, 2), "target_s": 10, "expectations": report["evaluated"],
            "drift_checks": len((report.get("drift") or {}).get("checks", [])), "valid": report["success"]}


def bench_lora_step(rows: int = 20_000) -> dict:
    """Training throughput of a LoRA adapter vs full training of the same base, on MovieLens rows."""
    import numpy as np

    from pipelines.config import LoraTrainConfig, ModelConfig
    from pipelines.data import movielens
    from pipelines.model import features
    from pipelines.model.base import CTRModel
    from pipelines.model import adapters
    from pipelines.training.loop import LoopSettings, train

    frame = movielens.load().head(rows)
    mcfg = ModelConfig()
    x, y = features.encode(frame, mcfg), features.labels(frame)
    settings = LoopSettings(epochs=1, batch_size=256, lr=1e-3, weight_decay=0.0, warmup_steps=10, seed=0)
    out = {"benchmark": "one epoch on MovieLens rows, batch 256, 1 thread", "rows": int(len(x))}
    for name, model in (("full", CTRModel(mcfg)), ("lora", adapters.attach(CTRModel(mcfg), LoraTrainConfig()))):
        t = time.perf_counter()
        train(model, x, y, settings, desc=name)
        out[f"{name}_samples_per_s"] = round(len(x) / (time.perf_counter() - t))
        out[f"{name}_trainable_fraction"] = round(adapters.trainable_fraction(model)["trainable_fraction"], 5)
    out["lora_speedup"] = round(out["lora_samples_per_s"] / out["full_samples_per_s"], 2)
    np.random.seed(0)
    return out


def bench_serving_quick() -> dict:
    """`python -m pipelines bench serving --quick`: adapter switch / load times, routed and merged latency."""
    from pipelines.bench import serving as bench_serving

    return {"benchmark": "multi-adapter serving, quick (goals: switch < 1 ms, load < 200 ms, routed/merged <= 1.2, "
                         "merged/base <= 1.05)", **{k: round(v, 3) for k, v in bench_serving.run(quick=True).items()}}


def bench_training_quick() -> dict:
    """`python -m pipelines bench training --quick`: LoRA vs dense AdamW vs SparseAdam on 2^20-row tables."""
    from pipelines.bench import training as bench_training

    r = bench_training.run(quick=True)
    keys = ("lora_samples_per_s", "full_samples_per_s", "sparse_full_samples_per_s", "speedup", "speedup_vs_sparse",
            "optimizer_state_ratio", "artifact_ratio", "trainable_fraction", "all_goals_met")
    return {"benchmark": "LoRA vs full fine-tuning, quick", **{k: r[k] for k in keys}}


def bench_headroom() -> dict:
    """`python -m pipelines bench headroom`: the best any variant gets above the one-hot LR (static protocol)."""
    from pipelines.bench import quality_headroom as bench_quality_headroom

    r = bench_quality_headroom.run()
    fs = r["few_shot_reference"]
    return {"benchmark": "MovieLens-100K headroom above the one-hot LR (goal margin 0.01)",
            "variants": len(r["rows"]), "max_delta_auc": r["max_delta_auc"], "max_delta_auc_cold": r["max_delta_auc_cold"],
            "chosen_on_validation": r["chosen_on_validation"],
            "few_shot_k": fs["k_shot"], "few_shot_delta_auc_cold": round(fs["lr_with_support"]["auc_cold"]
                                                                       - fs["lr_static"]["auc_cold"], 4)}


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM, Python {platform.python_version()}, {platform.system()}"


def write(results: list[dict], path: Path) -> None:
    lines = [BEGIN, f"Generated by `make bench` on {dt.date.today().isoformat()}; machine: {machine()}.", ""]
    for r in results:
        lines.append(f"- **{r['benchmark']}**: " + ", ".join(f"{k}={v}" for k, v in r.items() if k != "benchmark"))
    lines.append(END)
    block = "\n".join(lines)
    text = path.read_text() if path.exists() else "# Benchmarks\n\n"
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipelines.bench", description=__doc__)
    p.add_argument("--write", type=Path, help="update the generated section of this markdown file")
    p.add_argument("--rows", type=int, default=1_000_000, help="rows of the synthetic validation benchmark")
    a = p.parse_args(argv)
    results = []
    for fn in (lambda: bench_validation(a.rows), bench_lora_step, bench_serving_quick, bench_training_quick,
               bench_headroom):
        r = fn()
        r["peak_rss_mib"] = round(_rss_mib())
        print(json.dumps(r), flush=True)
        results.append(r)
    if a.write:
        write(results, a.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
