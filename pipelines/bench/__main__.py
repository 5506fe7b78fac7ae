"""`python -m pipelines.bench [--write docs/benchmarks.md]` (`make bench`): measured numbers, not timed tests.

Runs, in this order, and prints one JSON line each (plus the process's peak RSS so far, ``peak_rss_mib``):

1. validation: one synthetic day of ``--rows`` rows validated against a 7-day reference window
   (GX suite + drift + markers; `pipelines.bench.validation`), goal under 10 s;
2. LoRA step: one training epoch on MovieLens rows, LoRA adapter vs full training of the same base
   (samples/s, trainable fraction);
3. serving, quick: adapter switch and load times, routed vs merged vs base latency, and over HTTP
   (`pipelines.bench.serving`);
4. training, quick: LoRA vs dense AdamW vs SparseAdam on 2^20-row id tables (`pipelines.bench.training`);
5. headroom: how far above the one-hot LR any variant gets on MovieLens-100K
   (`pipelines.bench.quality_headroom`).

With --write, the results replace the generated section of the benchmarks document (between the
BEGIN/END markers), stamped with the date, the machine and the command. The quality comparison is
not one of them; run it alone: `python -m pipelines bench quality`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

from pipelines.bench.validation import bench_validation

BEGIN, END = "<!-- BEGIN make bench -->", "<!-- END make bench -->"


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


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

    return {
        "benchmark": "multi-adapter serving, quick (goals: switch < 1 ms, refresh after promote_canary < 120 ms, "
        "load < 200 ms, routed/merged <= 1.2, merged/base <= 1.05; over HTTP: promote visible "
        "(webhook) < 120 ms, p99 during swaps / p99 <= 1.2, failed = misrouted = 0)",
        **{k: round(v, 3) for k, v in bench_serving.run(quick=True).items()},
    }


def bench_training_quick() -> dict:
    """`python -m pipelines bench training --quick`: LoRA vs dense AdamW vs SparseAdam on 2^20-row tables."""
    from pipelines.bench import training as bench_training

    r = bench_training.run(quick=True)
    keys = (
        "lora_samples_per_s",
        "full_samples_per_s",
        "sparse_full_samples_per_s",
        "speedup",
        "speedup_vs_sparse",
        "optimizer_state_ratio",
        "artifact_ratio",
        "trainable_fraction",
        "all_goals_met",
    )
    return {"benchmark": "LoRA vs full fine-tuning, quick", **{k: r[k] for k in keys}}


def bench_headroom() -> dict:
    """`python -m pipelines bench headroom`: the best any variant gets above the one-hot LR (static protocol)."""
    from pipelines.bench import quality_headroom as bench_quality_headroom

    r = bench_quality_headroom.run()
    fs = r["few_shot_reference"]
    return {
        "benchmark": "MovieLens-100K headroom above the one-hot LR (goal margin 0.01)",
        "variants": len(r["rows"]),
        "max_delta_auc": r["max_delta_auc"],
        "max_delta_auc_cold": r["max_delta_auc_cold"],
        "chosen_on_validation": r["chosen_on_validation"],
        "few_shot_k": fs["k_shot"],
        "few_shot_delta_auc_cold": round(fs["lr_with_support"]["auc_cold"] - fs["lr_static"]["auc_cold"], 4),
    }


def machine() -> str:
    cpu = (
        next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            platform.processor(),
        )
        if Path("/proc/cpuinfo").exists()
        else ""
    )
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
        text = text[: text.index(BEGIN)] + block + text[text.index(END) + len(END) :]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pipelines.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--write", type=Path, help="update the generated section of this markdown file")
    p.add_argument("--rows", type=int, default=1_000_000, help="rows of the synthetic validation benchmark")
    a = p.parse_args(argv)
    results = []
    for fn in (
        lambda: bench_validation(a.rows),
        bench_lora_step,
        bench_serving_quick,
        bench_training_quick,
        bench_headroom,
    ):
        r = fn()
        r["peak_rss_mib"] = round(_rss_mib())
        print(json.dumps(r), flush=True)
        results.append(r)
    if a.write:
        write(results, a.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
