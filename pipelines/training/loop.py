"""A short linear training loop built from pure helpers (nanoGPT style).

Used for both the full base-model training and LoRA adapter training: what differs is only which
parameters require grad.
"""
from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pipelines.evaluation.metrics import auc, logloss

log = logging.getLogger(__name__)


def configure_threads() -> None:
    """One intra-op thread by default: these models are small, and OpenMP threads spinning against
    each other (or against a second task on a 2-core worker) made steps ~30x slower when measured."""
    import os

    torch.set_num_threads(int(os.environ.get("CTR_TORCH_THREADS", "1")))


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


@torch.no_grad()
def predict(model: nn.Module, tokens: np.ndarray, batch_size: int = 4096) -> np.ndarray:
    """pCTR for every row, in order, under no_grad and eval mode (restores the previous mode)."""
    configure_threads()
    was_training = model.training
    model.eval()
    out = [torch.sigmoid(model(torch.from_numpy(tokens[i:i + batch_size]))).numpy()
           for i in range(0, len(tokens), batch_size)]
    model.train(was_training)
    return np.concatenate(out) if out else np.zeros(0, dtype=np.float32)


@dataclass(frozen=True)
class LoopSettings:
    epochs: int
    batch_size: int
    lr: float
    weight_decay: float
    warmup_steps: int
    seed: int


def train(model: nn.Module, tokens: np.ndarray, y: np.ndarray, settings: LoopSettings,
          val: tuple[np.ndarray, np.ndarray] | None = None, desc: str = "train",
          on_epoch=None) -> list[dict]:
    """Train the parameters of `model` that require grad; return per-epoch metrics.

    `on_epoch(metrics_dict)` is called after each epoch (e.g. to log to MLflow).
    """
    configure_threads()
    seed_everything(settings.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("train(): the model has no trainable parameters")
    opt = torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)
    n = len(tokens)
    steps_per_epoch = max(1, math.ceil(n / settings.batch_size))
    total = steps_per_epoch * settings.epochs
    gen = torch.Generator().manual_seed(settings.seed)
    x_all, y_all = torch.from_numpy(tokens), torch.from_numpy(y)
    history, step = [], 0
    for epoch in range(settings.epochs):
        model.train()
        order = torch.randperm(n, generator=gen)
        t0, loss_sum = time.perf_counter(), 0.0
        for i in range(0, n, settings.batch_size):
            idx = order[i:i + settings.batch_size]
            for g in opt.param_groups:
                g["lr"] = lr_at(step, total, settings.lr, settings.warmup_steps)
            loss = bce_loss(model(x_all[idx]), y_all[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_sum += loss.item() * len(idx)
            step += 1
        secs = time.perf_counter() - t0
        metrics = {"epoch": epoch + 1, "train_loss": loss_sum / n, "samples_per_s": n / max(secs, 1e-9)}
        if val is not None and len(val[0]):
            p = predict(model, val[0])
            metrics.update(val_auc=auc(val[1], p), val_logloss=logloss(val[1], p))
        log.info("%s epoch %d/%d %s", desc, epoch + 1, settings.epochs,
                 " ".join(f"{k}={v:.4f}" for k, v in metrics.items() if k != "epoch"))
        history.append(metrics)
        if on_epoch:
            on_epoch(metrics)
    model.eval()
    return history
