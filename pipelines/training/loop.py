"""A short linear training loop built from pure helpers (nanoGPT style).

Used for both the full base-model training and LoRA adapter training: what differs is only which
parameters require grad. Rows come from a *source*: in-memory arrays (`ArraySource`) or anything
with `rows` and `batches(batch_size, gen)` (e.g. `pipelines.model.stream.LakeStream`). Each
epoch's order is drawn from one seeded torch generator, so a run is a pure function of the seed and
the data, and a checkpoint taken between epochs resumes it bit-exactly.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import random
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from pipelines.errors import LakeError
from pipelines.model.inference import as_source, configure_threads, evaluate
from pipelines.training.checkpoint import capture_rng, key_digest, restore_rng

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def lr_at(step: int, total_steps: int, base_lr: float, warmup_steps: int) -> float:
    """Linear warm-up, then cosine decay to 10% of base_lr."""
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return base_lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def bce_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits, targets)


@dataclass(frozen=True)
class LoopSettings:
    epochs: int
    batch_size: int
    lr: float
    weight_decay: float
    warmup_steps: int
    seed: int
    patience: int = 0  # early stopping: epochs without a lower val logloss before stopping; 0 = off
    # With early stopping: the weights before the first epoch are a candidate too (epoch 0). For an adapter
    # (LoRA B starts at zero) that is the base itself: when no epoch beats it on the val rows, none is kept.
    start_is_candidate: bool = False
    # adamw for dense weights; adagrad (per-coordinate steps that shrink with each row's own gradient history, as
    # FTRL's) for sparse per-id rows, whose ids appear a few times each (training.delta)
    optimizer: str = "adamw"


def _trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _weights(named: list[tuple[str, nn.Parameter]]) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in named}


@torch.no_grad()
def _set_weights(named: list[tuple[str, nn.Parameter]], weights: dict[str, torch.Tensor]) -> None:
    for n, p in named:
        p.copy_(weights[n])


def _fmt(metrics: dict) -> str:
    return " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items() if k != "epoch")


def _train_epoch(
    model: nn.Module,
    src,
    opt,
    gen: torch.Generator,
    st: dict,
    settings: LoopSettings,
    total: int,
    bar,
    regularizer=None,
) -> tuple[float, int]:
    """One pass over `src` (advances st["step"]; sets st["diverged"] on a non-finite loss). The loss
    returned is the data loss: a `regularizer`'s term is trained on but not reported in it."""
    model.train()
    loss_sum, seen = 0.0, 0
    for x, y in src.batches(settings.batch_size, gen):
        for g in opt.param_groups:
            g["lr"] = lr_at(st["step"], total, settings.lr, settings.warmup_steps)
        loss = bce_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        (loss + regularizer(model) if regularizer is not None else loss).backward()
        opt.step()
        value = loss.item()
        loss_sum += value * len(y)
        seen += len(y)
        st["step"] += 1
        if bar is not None:
            bar.update(1)
            if st["step"] % 50 == 0:
                bar.set_postfix(loss=f"{value:.4f}")
        if not math.isfinite(value):
            # NaN/inf weights never recover: stop here instead of burning the remaining epochs.
            st["diverged"] = st["stopped"] = True
            break
    return loss_sum, seen


def _select(st: dict, metrics: dict, named, patience: int, desc: str) -> None:
    """Early stopping bookkeeping: keep the best epoch's weights, stop after `patience` worse epochs."""
    best, ll = st["best"], metrics["val_logloss"]
    if math.isfinite(ll) and (best is None or ll < best["val_logloss"]):
        st["best"], st["bad_epochs"] = {"epoch": metrics["epoch"], "val_logloss": ll, "weights": _weights(named)}, 0
        return
    st["bad_epochs"] += 1
    if st["bad_epochs"] >= patience:
        st["stopped"] = True
        log.info(
            "%s: early stop after epoch %d: no lower val logloss for %d epochs (best %s)",
            desc,
            metrics["epoch"],
            st["bad_epochs"],
            f"{best['val_logloss']:.4f} at epoch {best['epoch']}" if best else "none",
        )


def fit(
    model: nn.Module,
    data,
    settings: LoopSettings,
    val=None,
    desc: str = "train",
    on_epoch=None,
    *,
    checkpoint=None,
    run_key: dict | None = None,
    progress: bool = False,
    regularizer=None,
) -> dict:
    """Train the parameters of `model` that require grad with AdamW or Adagrad (`settings.optimizer`;
    warm-up + cosine decay).

    `data` / `val`: (tokens, labels) arrays or batch sources. With `val`, every epoch is evaluated
    on it. With `settings.patience` > 0 too, training stops after that many epochs without a lower
    val logloss and the best epoch's weights are restored at the end (patience 0: `val` is only
    monitored and the last epoch's weights are kept, as the base model's training wants). A
    non-finite training loss stops training (diverged) and restores the best weights, if any.

    `checkpoint` (a CheckpointStore): written after every epoch and resumed from at the start when
    its run key matches (settings, trainable shapes, row counts and the caller's `run_key`); a
    resumed run ends with the same weights as an uninterrupted one (a `regularizer` must be named in
    `run_key`: the key cannot see it). `regularizer(model)`: a scalar tensor added to every batch's
    loss (training.orthogonality.Regularizer). `on_epoch(metrics)` is called
    after each epoch, and once per restored epoch on resume (so a fresh MLflow run gets the whole
    curve). Returns a JSON-safe dict: history, epochs_run, best_epoch, best_val_logloss,
    resumed_from_epoch, stopped_early, diverged. `settings.start_is_candidate`: the starting weights
    compete as epoch 0 (best_epoch 0: no epoch improved on them, and they are what the model ends with).
    """
    configure_threads()
    seed_everything(settings.seed)
    named = _trainable(model)
    if not named:
        raise ValueError("train(): the model has no trainable parameters")
    src = as_source(data)
    if src.rows == 0:
        raise ValueError("train(): no training rows")
    val_src = as_source(val) if val is not None else None
    if val_src is not None and val_src.rows == 0:
        val_src = None
    opt = _optimizer(settings, [p for _, p in named])
    total = math.ceil(src.rows / settings.batch_size) * settings.epochs
    gen = torch.Generator().manual_seed(settings.seed)
    key = _checkpoint_key(settings, src, val_src, named, run_key)
    st = {"epoch": 0, "step": 0, "history": [], "best": None, "bad_epochs": 0, "stopped": False, "diverged": False}
    resumed_from = _resume(checkpoint, key, st, named, opt, gen, settings, desc)
    for m in st["history"] if on_epoch else ():
        on_epoch(m)
    if settings.start_is_candidate and settings.patience > 0 and val_src is not None and st["epoch"] == 0:
        _select(st, {"epoch": 0, **evaluate(model, val_src)}, named, settings.patience, desc)

    while st["epoch"] < settings.epochs and not st["stopped"]:
        metrics = _fit_epoch(model, src, val_src, opt, gen, st, named, settings, total, desc, progress, regularizer)
        st["epoch"] = metrics["epoch"]
        st["history"].append(metrics)
        if checkpoint is not None:
            _save_checkpoint(checkpoint, st, key, named, opt, gen, desc)
        if on_epoch:
            on_epoch(metrics)
    return _finish(model, named, st, resumed_from, desc)


def _optimizer(settings: LoopSettings, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if settings.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)
    if settings.optimizer == "adagrad":
        return torch.optim.Adagrad(params, lr=settings.lr, weight_decay=settings.weight_decay)
    raise ValueError(f"LoopSettings.optimizer must be adamw or adagrad, got {settings.optimizer!r}")


def _checkpoint_key(settings: LoopSettings, src, val_src, named, run_key: dict | None) -> dict:
    """What a checkpoint must match to be resumed (JSON-normalised, as it is stored): the settings, the
    row counts, the trainable parameters' shapes and the caller's `run_key`."""
    return json.loads(
        json.dumps(
            {
                "settings": dataclasses.asdict(settings),
                "rows": src.rows,
                "val_rows": val_src.rows if val_src else 0,
                "params": {n: list(p.shape) for n, p in named},
                "run": run_key or {},
            },
            sort_keys=True,
            default=str,
        )
    )


def _resume(
    checkpoint, key: dict, st: dict, named, opt, gen: torch.Generator, settings: LoopSettings, desc: str
) -> int | None:
    """Restore weights, optimizer, generator and `st` from `checkpoint` when it was written by this run
    (same key); returns the epoch it resumes after, or None (no checkpoint, or another run's)."""
    saved = checkpoint.load() if checkpoint is not None else None
    if saved is None:
        return None
    if saved.get("key") != key:
        log.warning(
            "%s: checkpoint %s belongs to another run (key %s, this run %s): starting over",
            desc,
            checkpoint.location,
            key_digest(saved.get("key") or {}),
            key_digest(key),
        )
        return None
    _set_weights(named, saved["weights"])
    opt.load_state_dict(saved["optimizer"])
    restore_rng(saved["rng"], gen)
    st.update({k: saved[k] for k in st})
    log.info(
        "%s: resumed from %s after epoch %d/%d (step %d)",
        desc,
        checkpoint.location,
        st["epoch"],
        settings.epochs,
        st["step"],
    )
    return st["epoch"]


def _progress_bar(progress: bool, steps: int, label: str):
    if not progress:
        return None

    return tqdm(total=steps, desc=label, unit="batch", leave=False)


def _fit_epoch(
    model: nn.Module,
    src,
    val_src,
    opt,
    gen: torch.Generator,
    st: dict,
    named,
    settings: LoopSettings,
    total: int,
    desc: str,
    progress: bool,
    regularizer=None,
) -> dict:
    """Train the next epoch (advancing st["step"]), validate it (early stopping bookkeeping included)
    and return its metrics."""
    epoch = st["epoch"] + 1
    bar = _progress_bar(progress, math.ceil(src.rows / settings.batch_size), f"{desc} {epoch}/{settings.epochs}")
    t0 = time.perf_counter()
    try:
        loss_sum, seen = _train_epoch(model, src, opt, gen, st, settings, total, bar, regularizer)
    finally:
        if bar is not None:
            bar.close()
    secs = time.perf_counter() - t0
    if not st["diverged"] and seen != src.rows:
        raise ValueError(
            f"{desc}: the source yielded {seen} rows in epoch {epoch}, expected {src.rows} "
            "(did the data change during training?)"
        )
    metrics = {
        "epoch": epoch,
        "train_loss": loss_sum / max(seen, 1),
        "samples_per_s": seen / max(secs, 1e-9),
        "lr": opt.param_groups[0]["lr"],
    }
    if val_src is not None and not st["diverged"]:
        metrics.update(evaluate(model, val_src))
        if settings.patience > 0:
            _select(st, metrics, named, settings.patience, desc)
    if st["diverged"]:
        log.error(
            "%s epoch %d/%d: training loss became non-finite at step %d; stopping",
            desc,
            epoch,
            settings.epochs,
            st["step"],
        )
    log.info("%s epoch %d/%d %s", desc, epoch, settings.epochs, _fmt(metrics))
    return metrics


def _save_checkpoint(checkpoint, st: dict, key: dict, named, opt, gen: torch.Generator, desc: str) -> None:
    try:
        checkpoint.save(
            {**st, "key": key, "weights": _weights(named), "optimizer": opt.state_dict(), "rng": capture_rng(gen)}
        )
    except (OSError, LakeError) as exc:
        # A checkpoint only saves time on a re-run: a storage blip must not fail the training.
        log.warning("%s: could not write checkpoint %s after epoch %d: %s", desc, checkpoint.location, st["epoch"], exc)


def _finish(model: nn.Module, named, st: dict, resumed_from: int | None, desc: str) -> dict:
    """Restore the best epoch's weights (when early stopping kept one that is not the last) and report the run."""
    best = st["best"]
    if best is not None and best["epoch"] != st["epoch"]:
        log.info("%s: restoring the weights of epoch %d (val logloss %.4f)", desc, best["epoch"], best["val_logloss"])
        _set_weights(named, best["weights"])
    model.eval()
    return {
        "history": st["history"],
        "epochs_run": st["epoch"],
        "best_epoch": best["epoch"] if best else None,
        "best_val_logloss": best["val_logloss"] if best else None,
        "resumed_from_epoch": resumed_from,
        "stopped_early": st["stopped"] and not st["diverged"],
        "diverged": st["diverged"],
    }


def train(
    model: nn.Module,
    tokens: np.ndarray,
    y: np.ndarray,
    settings: LoopSettings,
    val: tuple[np.ndarray, np.ndarray] | None = None,
    desc: str = "train",
    on_epoch=None,
    **kwargs,
) -> list[dict]:
    """`fit` on in-memory arrays; returns the per-epoch metrics (see `fit` for the keyword options)."""
    return fit(model, (tokens, y), settings, val=val, desc=desc, on_epoch=on_epoch, **kwargs)["history"]
