"""`python -m pipelines.bench.training [--quick]`: LoRA vs full fine-tuning of the same CTR model.

One run measures three ways of training the *same* model (same seed, same weights at step 0) on the
*same* batches (synthetic ad rows encoded with `features.encode`), same batch size, one intra-op thread:

* ``full``        -- baseline (a): plain AdamW on every parameter; the embedding tables get dense
                     gradients and dense Adam state;
* ``sparse_full`` -- baseline (b), what a CTR engineer would write: every ``nn.Embedding`` of
                     ``model.embeddings`` replaced by ``nn.Embedding(n, d, sparse=True)`` holding the same
                     weights, ``torch.optim.SparseAdam`` for the tables and AdamW for the rest;
* ``lora``        -- ``pipelines.model.adapters.attach`` (frozen base, tables included) + AdamW on the
                     adapter, as the pipeline trains adapters.

The id tables have ``ModelConfig(id_buckets=1 << 20)`` rows (a realistic hashed-id table size), which
is what makes (a) expensive and what (b) and LoRA avoid in different ways.

Each variant runs in its own child process (``--variant NAME``) so its peak RSS is its own. Warm-up
steps are not timed. A step is: slice the batch, forward, BCE loss, zero_grad, backward, optimizer
step(s), ``loss.item()`` -- what ``pipelines.training.loop.train`` does. samples/s is batch size over
the *median* step time (robust to other processes on a shared 2-core machine); the mean-based figure
is reported next to it. The full run repeats the three children in 3 interleaved rounds and keeps each
variant's median round. Because LoRA and (b) differ by only ~10-15 % per step (both must run the
attention forward and backward of every block, which is about half of a step), a paired measurement
is added: one more child alternates LoRA and (b) steps on the same batches in one process
(``*_paired`` keys; timing only).

Reported per variant: samples/s, peak RSS, optimizer-state bytes (sum of the tensor bytes in each
optimizer's ``state``), trainable parameters, and artifact bytes -- what must be saved to ship the
result: the adapter's ``adapter_model.safetensors`` (``save_pretrained``) for LoRA, the full
``state_dict`` as safetensors for the two full variants.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from pipelines.config import REPO_ROOT, LoraTrainConfig, ModelConfig
from pipelines.data import synthetic
from pipelines.model import adapters, features
from pipelines.model.base import CTRModel

VARIANTS = ("full", "sparse_full", "lora")
BATCH_SIZE = 512
ID_BUCKETS = 1 << 20
LR = 1e-3
WEIGHT_DECAY = 1e-4  # BaseTrainConfig.weight_decay; AdamW groups only (SparseAdam has none)
DATA_SEED = 3
MODEL_SEED = 0

# Goals (GitHub issue 4, section 3)
GOAL_SPEEDUP = 6.0  # LoRA samples/s >= 6x baseline (a)
GOAL_SPEEDUP_VS_SPARSE = 1.0  # LoRA samples/s >= baseline (b)
GOAL_OPT_STATE_RATIO = 0.01  # LoRA optimizer state <= 1 % of (b)'s
GOAL_ARTIFACT_RATIO = 0.001  # LoRA artifact <= 0.1 % of (b)'s
GOAL_TRAINABLE_FRACTION = 0.01


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _current_rss_mib() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


# ----------------------------------------------------------------------------------------- data
def make_tokens(rows: int, id_buckets: int = ID_BUCKETS, seed: int = DATA_SEED) -> tuple[np.ndarray, np.ndarray]:
    """`rows` synthetic ad impressions (a day after the origin, so it holds cold ids too), encoded for a
    model with `id_buckets` id rows; rows are shuffled once (seeded) so batches mix the whole day."""
    spec = synthetic.SyntheticSpec(seed=seed)
    frame = pd.concat(list(synthetic.generate_day(spec, "2024-01-08", rows)), ignore_index=True)
    cfg = ModelConfig(id_buckets=id_buckets)
    x, y = features.encode(frame, cfg), features.labels(frame)
    order = np.random.default_rng(seed).permutation(len(x))
    return np.ascontiguousarray(x[order]), np.ascontiguousarray(y[order])


# --------------------------------------------------------------------------------------- models
def build(variant: str, id_buckets: int = ID_BUCKETS):
    """(model, [optimizers]) for `variant`; the model's weights are identical across variants."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")
    torch.manual_seed(MODEL_SEED)
    model = CTRModel(ModelConfig(id_buckets=id_buckets))
    if variant == "full":
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        return model.train(), [opt]
    if variant == "sparse_full":
        for name in list(model.embeddings):
            old = model.embeddings[name]
            # same weights (shared storage, no copy), sparse gradients
            model.embeddings[name] = nn.Embedding.from_pretrained(old.weight.detach(), freeze=False, sparse=True)
        table_params = [e.weight for e in model.embeddings.values()]
        table_ids = {id(p) for p in table_params}
        rest = [p for p in model.parameters() if id(p) not in table_ids]
        opts = [torch.optim.SparseAdam(table_params, lr=LR), torch.optim.AdamW(rest, lr=LR, weight_decay=WEIGHT_DECAY)]
        return model.train(), opts

    model = adapters.attach(model, LoraTrainConfig())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WEIGHT_DECAY)
    return model.train(), [opt]


def optimizer_state_bytes(opts) -> int:
    total = 0
    for opt in opts:
        for state in opt.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    total += v.numel() * v.element_size()
    return int(total)


def artifact_bytes(variant: str, model, directory: Path) -> int:
    """Bytes of what must be saved to ship the result of training."""
    if variant == "lora":
        model.save_pretrained(str(directory))
        return (directory / "adapter_model.safetensors").stat().st_size

    path = directory / "model.safetensors"
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(path))
    return path.stat().st_size


def _step(model, opts, xb, yb) -> tuple[float, float, float, float]:
    """One training step, as pipelines.training.loop.train does it; returns (forward s, backward s,
    optimizer s, loss). Batch slicing happens before the clock starts (it is a view)."""
    t0 = time.perf_counter()
    loss = F.binary_cross_entropy_with_logits(model(xb), yb)
    t1 = time.perf_counter()
    for opt in opts:
        opt.zero_grad(set_to_none=True)
    loss.backward()
    t2 = time.perf_counter()
    for opt in opts:
        opt.step()
    value = loss.item()
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2, value


def _measure(
    variant: str,
    steps: int = 3,
    warmup: int = 1,
    id_buckets: int = ID_BUCKETS,
    batch_size: int = BATCH_SIZE,
    data: tuple[np.ndarray, np.ndarray] | None = None,
    threads: int = 1,
) -> dict:
    """Train `variant` for `warmup` untimed + `steps` timed steps in this process; return its numbers.

    `data` (tokens, labels) must hold at least (warmup + steps) * batch_size rows; made here if None.
    """
    torch.set_num_threads(threads)
    if data is None:
        data = make_tokens((warmup + steps) * batch_size, id_buckets)
    x_np, y_np = data
    need = (warmup + steps) * batch_size
    if len(x_np) < need:
        raise ValueError(f"need {need} rows for {warmup}+{steps} steps of {batch_size}, got {len(x_np)}")
    x_all, y_all = torch.from_numpy(np.asarray(x_np)), torch.from_numpy(np.asarray(y_np))
    rss_before_model = _current_rss_mib()
    model, opts = build(variant, id_buckets)
    times, phases, losses = [], [], []
    for step in range(warmup + steps):
        lo = step * batch_size
        fwd, bwd, opt_s, loss = _step(model, opts, x_all[lo : lo + batch_size], y_all[lo : lo + batch_size])
        losses.append(loss)
        if step >= warmup:
            times.append(fwd + bwd + opt_s)
            phases.append((fwd, bwd, opt_s))
    peak_rss = _rss_mib()  # before saving the artifact (serialisation buffers are not training memory)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    with tempfile.TemporaryDirectory() as tmp:
        art = artifact_bytes(variant, model, Path(tmp))
    med, mean = statistics.median(times), statistics.fmean(times)
    return {
        "variant": variant,
        "steps": steps,
        "warmup_steps": warmup,
        "batch_size": batch_size,
        "id_buckets": id_buckets,
        "threads": threads,
        "samples_per_s": batch_size / med,
        "samples_per_s_mean": batch_size / mean,
        "step_ms_median": 1000 * med,
        "step_ms_p90": 1000 * float(np.quantile(times, 0.9)),
        # where a step's time goes (medians of each phase; they need not add up to the step median)
        "forward_ms": 1000 * statistics.median(p[0] for p in phases),
        "backward_ms": 1000 * statistics.median(p[1] for p in phases),
        "optimizer_ms": 1000 * statistics.median(p[2] for p in phases),
        "peak_rss_mib": peak_rss,
        "rss_before_model_mib": rss_before_model,
        "optimizer_state_bytes": optimizer_state_bytes(opts),
        "trainable_params": int(trainable),
        "total_params": int(total),
        "trainable_fraction": trainable / max(total, 1),
        "artifact_bytes": int(art),
        "first_loss": losses[0],
        "last_loss": losses[-1],
    }


def _paired(
    steps: int = 3,
    warmup: int = 1,
    id_buckets: int = ID_BUCKETS,
    batch_size: int = BATCH_SIZE,
    data: tuple[np.ndarray, np.ndarray] | None = None,
    threads: int = 1,
) -> dict:
    """LoRA vs baseline (b) in ONE process, alternating steps on the same batch (order flipped every
    step): a paired measurement, so load from other processes on a shared machine hits both alike.
    Only timing comes from here (RSS would be the sum of both models)."""
    torch.set_num_threads(threads)
    if data is None:
        data = make_tokens((warmup + steps) * batch_size, id_buckets)
    x_all, y_all = torch.from_numpy(np.asarray(data[0])), torch.from_numpy(np.asarray(data[1]))
    models = {v: build(v, id_buckets) for v in ("sparse_full", "lora")}
    times: dict[str, list[float]] = {v: [] for v in models}
    for step in range(warmup + steps):
        lo = step * batch_size
        xb, yb = x_all[lo : lo + batch_size], y_all[lo : lo + batch_size]
        order = list(models) if step % 2 == 0 else list(models)[::-1]
        for v in order:
            f, b, o, _ = _step(*models[v], xb, yb)
            if step >= warmup:
                times[v].append(f + b + o)
    ratios = [tb / tl for tb, tl in zip(times["sparse_full"], times["lora"])]
    return {
        "variant": "paired",
        "steps": steps,
        "warmup_steps": warmup,
        "speedup_vs_sparse_paired": statistics.median(ratios),
        "lora_samples_per_s_paired": batch_size / statistics.median(times["lora"]),
        "sparse_full_samples_per_s_paired": batch_size / statistics.median(times["sparse_full"]),
        "paired_steps_lora_faster_fraction": sum(r > 1 for r in ratios) / len(ratios),
    }


# ------------------------------------------------------------------------------------ summary
def summarize(results: dict[str, dict], paired: dict | None = None) -> dict:
    """One flat JSON-safe dict: headline ratios, goal booleans, then every per-variant number.

    The headline samples/s and ratios come from the per-variant child processes. `paired` (from
    `_paired`) adds the same-process alternating LoRA-vs-(b) comparison and its own goal check."""
    a, b, lo = results["full"], results["sparse_full"], results["lora"]
    out = {
        "benchmark": "LoRA vs full fine-tuning (dense AdamW; sparse tables + SparseAdam), same model/data/batch",
        "lora_samples_per_s": round(lo["samples_per_s"], 1),
        "full_samples_per_s": round(a["samples_per_s"], 1),
        "sparse_full_samples_per_s": round(b["samples_per_s"], 1),
        "speedup": round(lo["samples_per_s"] / a["samples_per_s"], 3),
        "speedup_vs_sparse": round(lo["samples_per_s"] / b["samples_per_s"], 3),
        "optimizer_state_ratio": float(f"{lo['optimizer_state_bytes'] / max(b['optimizer_state_bytes'], 1):.6g}"),
        "artifact_ratio": float(f"{lo['artifact_bytes'] / max(b['artifact_bytes'], 1):.6g}"),
        "trainable_fraction": float(f"{lo['trainable_fraction']:.6g}"),
    }
    out.update(
        {
            "goal_speedup_6x": out["speedup"] >= GOAL_SPEEDUP,
            "goal_faster_than_sparse": out["speedup_vs_sparse"] >= GOAL_SPEEDUP_VS_SPARSE,
            "goal_optimizer_state_le_1pct": out["optimizer_state_ratio"] <= GOAL_OPT_STATE_RATIO,
            "goal_artifact_le_0_1pct": out["artifact_ratio"] <= GOAL_ARTIFACT_RATIO,
            "goal_trainable_lt_1pct": out["trainable_fraction"] < GOAL_TRAINABLE_FRACTION,
        }
    )
    out["all_goals_met"] = all(v for k, v in out.items() if k.startswith("goal_"))
    if paired is not None:
        out.update(
            {
                k: float(f"{paired[k]:.6g}")
                for k in (
                    "speedup_vs_sparse_paired",
                    "lora_samples_per_s_paired",
                    "sparse_full_samples_per_s_paired",
                    "paired_steps_lora_faster_fraction",
                )
            }
        )
        out["paired_steps"] = paired["steps"]
        out["goal_faster_than_sparse_paired"] = out["speedup_vs_sparse_paired"] >= GOAL_SPEEDUP_VS_SPARSE
    keys = (
        "steps",
        "warmup_steps",
        "samples_per_s_mean",
        "step_ms_median",
        "step_ms_p90",
        "forward_ms",
        "backward_ms",
        "optimizer_ms",
        "peak_rss_mib",
        "rss_before_model_mib",
        "optimizer_state_bytes",
        "trainable_params",
        "total_params",
        "trainable_fraction",
        "artifact_bytes",
        "first_loss",
        "last_loss",
    )
    for name, r in results.items():
        for k in keys:
            v = r[k]
            out[f"{name}_{k}"] = float(f"{v:.6g}") if isinstance(v, float) else v
    first = next(iter(results.values()))
    out.update({k: first[k] for k in ("batch_size", "id_buckets", "threads")})
    if "repeats" in first:
        out["repeats"] = first["repeats"]
    return out


# -------------------------------------------------------------------------------------- driver
def _child(variant: str, data_path: Path, steps: int, warmup: int, id_buckets: int, batch_size: int) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "pipelines.bench.training",
        "--variant",
        variant,
        "--data",
        str(data_path),
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
        "--id-buckets",
        str(id_buckets),
        "--batch-size",
        str(batch_size),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"bench child {variant} failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _run(
    steps: int,
    warmup: int,
    repeats: int = 1,
    full_steps: int | None = None,
    full_warmup: int | None = None,
    id_buckets: int = ID_BUCKETS,
    batch_size: int = BATCH_SIZE,
) -> dict:
    """Each variant in its own child process, `repeats` rounds interleaved (a, b, lora, a, b, lora, ...);
    per variant the round with the median samples/s is kept.

    Every variant trains on the same batch sequence from the same initial weights. Baseline (a) is ~30x
    slower per step and its step time is flat (dense Adam over every table row each step), so it may
    time fewer steps (`full_steps`): it then sees a prefix of the same sequence.
    """
    full_steps = steps if full_steps is None else full_steps
    full_warmup = warmup if full_warmup is None else full_warmup
    x, y = make_tokens((warmup + steps) * batch_size, id_buckets)
    with tempfile.TemporaryDirectory() as tmp:
        data_path = Path(tmp) / "batches.npz"
        np.savez(data_path, x=x, y=y)
        rounds: dict[str, list[dict]] = {v: [] for v in VARIANTS}
        for _ in range(repeats):
            for v in VARIANTS:
                s, w = (full_steps, full_warmup) if v == "full" else (steps, warmup)
                rounds[v].append(_child(v, data_path, s, w, id_buckets, batch_size))
        paired = _child("paired", data_path, steps, warmup, id_buckets, batch_size)
    results = {}
    for v, rs in rounds.items():
        rs = sorted(rs, key=lambda r: r["samples_per_s"])
        results[v] = dict(rs[len(rs) // 2], repeats=repeats)
    out = summarize(results, paired)
    for v in VARIANTS:
        out[f"{v}_samples_per_s_rounds"] = [round(r["samples_per_s"], 1) for r in rounds[v]]
    return out


def run(quick: bool = False) -> dict:
    """Measure the three variants; `quick` (< 60 s) uses fewer steps and one round, the full run three."""
    t = time.perf_counter()
    if quick:
        out = _run(steps=40, warmup=5, repeats=1, full_steps=6, full_warmup=2)
    else:
        out = _run(steps=300, warmup=10, repeats=3, full_steps=30, full_warmup=3)
    out["quick"] = quick
    out["wall_s"] = round(time.perf_counter() - t, 1)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pipelines.bench.training",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="fewer steps, one round (< 60 s)")
    p.add_argument("--variant", choices=VARIANTS + ("paired",), help=argparse.SUPPRESS)  # child mode
    p.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=20, help=argparse.SUPPRESS)
    p.add_argument("--warmup", type=int, default=3, help=argparse.SUPPRESS)
    p.add_argument("--id-buckets", type=int, default=ID_BUCKETS, help=argparse.SUPPRESS)
    p.add_argument("--batch-size", type=int, default=BATCH_SIZE, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.variant:
        data = None
        if a.data:
            with np.load(a.data) as z:
                data = (z["x"], z["y"])
        fn = _paired if a.variant == "paired" else functools.partial(_measure, a.variant)
        r = fn(steps=a.steps, warmup=a.warmup, id_buckets=a.id_buckets, batch_size=a.batch_size, data=data)
    else:
        r = run(quick=a.quick)
    print(json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
