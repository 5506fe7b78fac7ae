"""Inference: a model's scores for encoded rows, in order, under no_grad and eval mode.

Shared by training (validation each epoch), evaluation, distillation (teacher logits), the registry's
pyfunc and serving, so it sits in the model layer below all of them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from typing import Iterator

import numpy as np
import torch
from torch import nn

from pipelines.metrics import auc, logloss


def configure_threads() -> None:
    """One intra-op thread by default: these models are small, and OpenMP threads spinning against
    each other (or against a second task on a 2-core worker) made steps ~30x slower when measured."""
    torch.set_num_threads(int(os.environ.get("CTR_TORCH_THREADS", "1")))
    bound_heap_growth()


_HEAP_BOUNDED = False


def bound_heap_growth() -> None:
    """Keep glibc from growing the heap with every scored batch (Linux only; once per process).

    glibc raises its mmap threshold each time a large block is freed, after which the multi-MB
    activations of a 4096-row scoring batch come from the heap and fragment it: scoring a 1.2M-row
    holdout grew the peak RSS from 0.55 to 2.5 GB, about 1.2 KB per row. A fixed threshold
    (M_MMAP_THRESHOLD = 128 KiB, glibc's initial value) keeps them in mmap'd blocks that go back to
    the OS: 0.68 GB for the same rows (docs/benchmarks.md).
    """
    global _HEAP_BOUNDED
    if _HEAP_BOUNDED:
        return
    _HEAP_BOUNDED = True

    threshold = int(os.environ.get("CTR_MMAP_THRESHOLD", 4 << 20))  # 0: leave glibc's dynamic threshold
    if not sys.platform.startswith("linux") or threshold <= 0:
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, threshold)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc (e.g. musl): nothing to tune
        pass


@torch.no_grad()
def predict(model: nn.Module, tokens: np.ndarray, batch_size: int = 4096) -> np.ndarray:
    """pCTR for every row, in order, under no_grad and eval mode (restores the previous mode)."""
    configure_threads()
    was_training = model.training
    model.eval()
    out = [
        torch.sigmoid(model(torch.from_numpy(tokens[i : i + batch_size]))).numpy()
        for i in range(0, len(tokens), batch_size)
    ]
    model.train(was_training)
    return np.concatenate(out) if out else np.zeros(0, dtype=np.float32)


class ArraySource:
    """In-memory rows. Shuffled batches are one `randperm` per epoch from the loop's generator."""

    def __init__(self, tokens: np.ndarray, y: np.ndarray):
        self.x, self.y = torch.from_numpy(tokens), torch.from_numpy(y)
        self.rows = len(tokens)

    def batches(
        self, batch_size: int, gen: torch.Generator | None = None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Shuffled with `gen`, in row order without it."""
        order = torch.randperm(self.rows, generator=gen) if gen is not None else None
        for i in range(0, self.rows, batch_size):
            if order is None:
                yield self.x[i : i + batch_size], self.y[i : i + batch_size]
            else:
                idx = order[i : i + batch_size]
                yield self.x[idx], self.y[idx]


def as_source(data):
    """(tokens, labels) arrays -> ArraySource; a source passes through."""
    if isinstance(data, tuple):
        return ArraySource(*data)
    if not (hasattr(data, "rows") and hasattr(data, "batches")):
        raise TypeError(f"not a (tokens, labels) tuple nor a batch source: {type(data).__name__}")
    return data


@torch.no_grad()
def evaluate_arrays(model: nn.Module, source, batch_size: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    """(labels, pCTR) over a source's rows in order, under no_grad and eval mode (restores the mode)."""
    configure_threads()
    was_training = model.training
    model.eval()
    ps, ys = [], []
    for x, y in source.batches(batch_size, None):
        ps.append(torch.sigmoid(model(x)).numpy())
        ys.append(y.numpy())
    model.train(was_training)
    if not ys:
        return np.zeros(0, np.float32), np.zeros(0, np.float32)
    return np.concatenate(ys), np.concatenate(ps)


def evaluate(model: nn.Module, source, batch_size: int = 4096) -> dict:
    """val_auc / val_logloss over a source's rows in order, under no_grad and eval mode."""
    y, p = evaluate_arrays(model, source, batch_size)
    return {"val_auc": auc(y, p), "val_logloss": logloss(y, p)}


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The CTRModel inside a PEFT wrapper (LoRA layers are injected in place, so they still apply)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def logits_and_pooled(model: nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [batch], pooled [batch, D]) in one pass; logits are exactly what `model(tokens)` gives.

    The pooled representation is the mean over fields of the final LayerNorm's output, the vector
    the head reads: CTRModel.forward is `head(norm(blocks(embed(x))).mean(1))`.
    """
    return unwrap_peft(model).logits_and_pooled(tokens)  # includes the optional first-order (wide) term


def forward_by_group(
    models: dict, tokens: np.ndarray, groups: np.ndarray, batch_size: int = 4096
) -> tuple[np.ndarray, np.ndarray]:
    """Logits and pooled representations of each row from the model of its group (e.g. its slot's
    teacher), under no_grad and eval mode; rows keep their order. `models[None]`, if present, serves
    groups that have no model of their own."""
    n = len(tokens)
    logits = np.zeros(n, dtype=np.float32)
    pooled = None
    groups = np.asarray([str(g) for g in groups], dtype=object)
    for g in sorted(set(groups)):
        model = models.get(g, models.get(None))
        if model is None:
            raise KeyError(f"no model for group {g!r} and no default (key None)")
        idx = np.flatnonzero(groups == g)
        was_training = model.training
        model.eval()
        with torch.no_grad():
            for i in range(0, len(idx), batch_size):
                rows = idx[i : i + batch_size]
                lg, h = logits_and_pooled(model, torch.from_numpy(tokens[rows]))
                if pooled is None:
                    pooled = np.zeros((n, h.shape[1]), dtype=np.float32)
                logits[rows], pooled[rows] = lg.numpy(), h.numpy()
        model.train(was_training)
    return logits, (pooled if pooled is not None else np.zeros((0, 0), dtype=np.float32))
