"""Cold-start distillation: pure loss terms, the covariance initialisation of LoRA A, and the loop.

The student is the frozen serving base with a fresh LoRA adapter (PEFT); the teacher is whatever
serves the rows today (a slot's `@champion` adapter, or the base). The loss on one step is

    w_bce   * BCE(student, labels)                      on a batch of the few labelled cold rows
  + w_kd    * T^2 * KL(Bern(sigma(t/T)) || Bern(sigma(s/T)))   on a batch of the (unlabelled) transfer set
  + w_align * MSE or (1 - cos)(pooled_student, pooled_teacher) on the same transfer batch

Every term is a pure function of tensors (no model, no state) and is 0 when the student equals the
teacher. The teacher's logits and pooled representations are computed once, before training
(`forward_by_group`), so the loop never runs the teacher.

LoRA A from behaviour covariance (`covariance_lora_A`): the user-embedding rows of the base for the
users of the transfer set, weighted by their impressions, give a D x D covariance C (weighted mean
removed). Its top-r eigenvectors u_1..u_r (eigh, descending eigenvalues l_1 >= ... >= l_r) become
the rows of A:

    A_i = s * sqrt(l_i / mean(l_1..l_r)) * u_i,   s = 1 / sqrt(3)

s is the expected row norm of PEFT's default A (kaiming-uniform with a=sqrt(5): entries U(-1/sqrt(D),
1/sqrt(D)), variance 1/(3D), row norm^2 = 1/3), so A has the default's expected Frobenius norm
(r/3) and only its directions and the relative weight of the directions change: the first update
directions the adapter can take are those along which users' behaviour varies most. Eigenvalues are
floored at 1% of l_1 so no row is (near) zero: a zero row of A is a dead rank (neither it nor the
matching column of B ever gets a gradient). B stays 0, so the student starts exactly at the base.
Eigenvector signs are fixed (largest-|.| component positive) so the init is reproducible.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace
from typing import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from peft.tuners.lora import LoraLayer
from torch import nn

from pipelines.config import LossWeights
from pipelines.metrics import auc, logloss
from pipelines.model.inference import configure_threads, logits_and_pooled, predict, unwrap_peft
from pipelines.training.loop import lr_at, seed_everything

log = logging.getLogger(__name__)

KAIMING_ROW_NORM = 1.0 / math.sqrt(3.0)  # E||row of PEFT's default LoRA A|| (see module docstring)
EIGEN_FLOOR = 0.01


# ----------------------------------------------------------------------------- loss terms (pure)
def bce_term(student_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean binary cross-entropy of the student's logits against 0/1 labels (0 for an empty batch)."""
    if student_logits.numel() == 0:
        return student_logits.sum() * 0.0
    return F.binary_cross_entropy_with_logits(student_logits, labels.to(student_logits.dtype))


def kd_term(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Temperature-scaled distillation for a binary output: T^2 * mean KL(teacher_T || student_T).

    teacher_T = Bernoulli(sigmoid(t / T)), student_T = Bernoulli(sigmoid(s / T)). The KL equals the
    soft-label BCE minus the teacher's entropy, so it has the BCE's gradient and is exactly 0 when
    s == t. The T^2 factor keeps the gradient's scale independent of T (Hinton et al., 2015).
    Computed with log-sigmoids, stable for any logit.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if student_logits.numel() == 0:
        return student_logits.sum() * 0.0
    s, t = student_logits / temperature, teacher_logits.detach() / temperature
    p = torch.sigmoid(t)
    kl = p * (F.logsigmoid(t) - F.logsigmoid(s)) + (1 - p) * (F.logsigmoid(-t) - F.logsigmoid(-s))
    return temperature**2 * kl.mean()


def align_term(student_h: torch.Tensor, teacher_h: torch.Tensor, kind: str = "mse") -> torch.Tensor:
    """Alignment of pooled representations [batch, D]: mean squared error, or mean (1 - cosine)."""
    if student_h.numel() == 0:
        return student_h.sum() * 0.0
    teacher_h = teacher_h.detach()
    if kind == "mse":
        return F.mse_loss(student_h, teacher_h)
    if kind == "cosine":
        return (1.0 - F.cosine_similarity(student_h, teacher_h, dim=-1, eps=1e-8)).mean()
    raise ValueError(f"unknown alignment {kind!r}; expected 'mse' or 'cosine'")


def distill_loss(
    w: LossWeights,
    *,
    labelled_logits: torch.Tensor,
    labels: torch.Tensor,
    transfer_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    transfer_h: torch.Tensor,
    teacher_h: torch.Tensor,
) -> tuple[torch.Tensor, dict]:
    """The weighted sum of the three terms, and each term's value (floats, for logging)."""
    parts = {
        "bce": bce_term(labelled_logits, labels) if w.bce else None,
        "kd": kd_term(transfer_logits, teacher_logits, w.temperature) if w.kd else None,
        "align": align_term(transfer_h, teacher_h, w.align_kind) if w.align else None,
    }
    total = sum(getattr(w, k) * v for k, v in parts.items() if v is not None)
    if not isinstance(total, torch.Tensor):
        raise ValueError("distill_loss: every loss weight is 0")
    return total, {k: float(v.detach()) for k, v in parts.items() if v is not None}


# ----------------------------------------------------------------------------- covariance init
def behaviour_covariance(vectors: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Weighted covariance [D, D] of row vectors [N, D] (weights >= 0, e.g. impressions per user)."""
    x = vectors.detach().to(torch.float64)
    if x.ndim != 2 or len(x) == 0:
        raise ValueError(f"need a non-empty [N, D] matrix, got shape {tuple(x.shape)}")
    w = torch.ones(len(x), dtype=torch.float64) if weights is None else torch.as_tensor(weights, dtype=torch.float64)
    if (w < 0).any() or w.sum() <= 0:
        raise ValueError("weights must be >= 0 with a positive sum")
    w = w / w.sum()
    mu = (w[:, None] * x).sum(0)
    xc = x - mu
    return (xc * w[:, None]).T @ xc


def principal_directions(cov: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-r eigenvalues (descending) and eigenvectors as rows [r, D], signs fixed (largest-|.| > 0)."""
    d = cov.shape[0]
    if not 1 <= r <= d:
        raise ValueError(f"rank r={r} must be in [1, D={d}]")
    vals, vecs = torch.linalg.eigh(cov.to(torch.float64))  # ascending
    vals, vecs = vals.flip(0)[:r].clamp_min(0.0), vecs.flip(1)[:, :r].T.contiguous()
    pivot = vecs.abs().argmax(dim=1)
    signs = torch.sign(vecs[torch.arange(r), pivot])
    return vals, vecs * signs[:, None]


def covariance_lora_A(
    cov: torch.Tensor, r: int, row_norm: float = KAIMING_ROW_NORM, floor: float = EIGEN_FLOOR
) -> torch.Tensor:
    """A [r, D] = row_norm * sqrt(l_i / mean(l)) * u_i (see the module docstring), float32."""
    vals, vecs = principal_directions(cov, r)
    top = vals[0] if vals[0] > 0 else torch.tensor(1.0, dtype=vals.dtype)
    vals = torch.maximum(vals, floor * top)
    scale = row_norm * torch.sqrt(vals / vals.mean())
    return (vecs * scale[:, None]).to(torch.float32)


def set_lora_A(model: nn.Module, A: torch.Tensor, adapter_name: str = "default") -> list[str]:
    """Copy A into the lora_A of every LoRA-wrapped module and zero its B; returns the module names."""
    done = []
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, LoraLayer) and adapter_name in module.lora_A:
                weight = module.lora_A[adapter_name].weight
                if tuple(weight.shape) != tuple(A.shape):
                    raise ValueError(f"{name}: lora_A is {tuple(weight.shape)}, the init is {tuple(A.shape)}")
                weight.copy_(A)
                module.lora_B[adapter_name].weight.zero_()
                done.append(name)
    if not done:
        raise ValueError("the model has no LoRA layers to initialise")
    return done


def user_embedding_rows(model: nn.Module, user_tokens: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows of the base's `embeddings.user_id` table, impressions) for the distinct user tokens
    among `user_tokens` (one per impression)."""
    base = unwrap_peft(model)
    tokens = np.asarray(user_tokens, dtype=np.int64)
    if getattr(base.cfg, "wide_id_buckets", 0):  # tokens range over the wide table's rows (features.token_sizes)
        tokens = tokens % base.cfg.id_buckets
    uniq, counts = np.unique(tokens, return_counts=True)
    table = base.embeddings["user_id"].weight.detach()
    return table[torch.from_numpy(uniq)], torch.from_numpy(counts.astype(np.float64))


# ----------------------------------------------------------------------------- the loop
@dataclass(frozen=True)
class DistillSettings:
    epochs: int
    batch_size: int  # labelled rows per step (an epoch is one pass over the labelled rows)
    transfer_batch_size: int  # transfer rows per step (cycled through the transfer set)
    lr: float
    weight_decay: float
    warmup_steps: int
    seed: int
    weights: LossWeights = LossWeights()


@dataclass
class TransferSet:
    """Rows the teacher labels softly: tokens, teacher logits, teacher pooled representations."""

    tokens: np.ndarray
    teacher_logits: np.ndarray
    teacher_pooled: np.ndarray

    def __len__(self) -> int:
        return len(self.tokens)


def distill(
    student: nn.Module,
    labelled: tuple[np.ndarray, np.ndarray],
    transfer: TransferSet | None,
    settings: DistillSettings,
    val: tuple[np.ndarray, np.ndarray] | None = None,
    on_epoch: Callable[[dict], None] | None = None,
    desc: str = "distill",
) -> list[dict]:
    """Train the parameters of `student` that require grad (its LoRA matrices) on the loss above.

    With weights kd = align = 0 and no transfer set this is plain BCE fine-tuning on the labelled
    rows with the same steps, schedule and seed: the no-distillation baseline.
    """
    configure_threads()
    seed_everything(settings.seed)
    x_l, y_l = labelled
    w, use_transfer = _active_weights(settings.weights, len(x_l), transfer)
    params = [p for p in student.parameters() if p.requires_grad]
    if not params:
        raise ValueError("distill(): the student has no trainable parameters")
    opt = torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)
    gen = torch.Generator().manual_seed(settings.seed)
    xl, yl = torch.from_numpy(np.ascontiguousarray(x_l)), torch.from_numpy(np.asarray(y_l, dtype=np.float32))
    n_l, n_t = len(x_l) if w.bce else 0, len(transfer) if use_transfer else 0
    transfer_batches = _TransferBatches(transfer, settings.transfer_batch_size, gen) if use_transfer else None
    steps_per_epoch = math.ceil(n_l / settings.batch_size) if n_l else math.ceil(n_t / settings.transfer_batch_size)
    total = steps_per_epoch * settings.epochs
    history, step = [], 0
    for epoch in range(settings.epochs):
        student.train()
        t0, sums, count = time.perf_counter(), {}, 0
        for labelled_batch, transfer_batch in _epoch_batches(
            xl, yl, n_l, transfer_batches, steps_per_epoch, settings.batch_size, gen
        ):
            lr = lr_at(step, total, settings.lr, settings.warmup_steps)
            for name, v in _step(student, opt, w, lr, labelled_batch, transfer_batch).items():
                sums[name] = sums.get(name, 0.0) + v
            step += 1
            count += 1
        metrics = _epoch_metrics(student, epoch, sums, count, time.perf_counter() - t0, val)
        log.info(
            "%s epoch %d/%d %s",
            desc,
            epoch + 1,
            settings.epochs,
            " ".join(f"{k}={v:.4f}" for k, v in metrics.items() if k != "epoch"),
        )
        history.append(metrics)
        if on_epoch:
            on_epoch(metrics)
    student.eval()
    return history


def _active_weights(w: LossWeights, labelled_rows: int, transfer: TransferSet | None) -> tuple[LossWeights, bool]:
    """The weights `distill` trains with, and whether it uses the transfer set (only when kd or align
    needs it): a term with no rows to train on gets weight 0."""
    use_transfer = transfer is not None and len(transfer) > 0 and (w.kd > 0 or w.align > 0)
    if w.bce > 0 and labelled_rows == 0 and not use_transfer:
        raise ValueError("distill(): no labelled rows and no transfer set")
    if not use_transfer:
        w = replace(w, kd=0.0, align=0.0)
    if w.bce == 0 or labelled_rows == 0:
        w = replace(w, bce=0.0)
    return w, use_transfer


class _TransferBatches:
    """The transfer set as tensors, cycled in seeded random order: a fresh permutation (from `gen`)
    whenever the next batch would run past the end, so every batch is full-sized."""

    def __init__(self, transfer: TransferSet, batch_size: int, gen: torch.Generator):
        self.tokens = torch.from_numpy(np.ascontiguousarray(transfer.tokens))
        self.teacher_logits = torch.from_numpy(np.asarray(transfer.teacher_logits, dtype=np.float32))
        self.teacher_pooled = torch.from_numpy(np.asarray(transfer.teacher_pooled, dtype=np.float32))
        self.batch_size, self.gen = batch_size, gen
        self.order, self.pos = torch.randperm(len(self.tokens), generator=gen), 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.pos + self.batch_size > len(self.tokens):
            self.order, self.pos = torch.randperm(len(self.tokens), generator=self.gen), 0
        idx = self.order[self.pos : self.pos + self.batch_size]
        self.pos += self.batch_size
        return self.tokens[idx], self.teacher_logits[idx], self.teacher_pooled[idx]


def _epoch_batches(
    xl: torch.Tensor,
    yl: torch.Tensor,
    n_l: int,
    transfer: _TransferBatches | None,
    steps: int,
    batch_size: int,
    gen: torch.Generator,
) -> Iterator[tuple[tuple, tuple]]:
    """One epoch's ((tokens, labels), (tokens, teacher logits, teacher pooled)) batches: the first n_l
    labelled rows in a fresh seeded order (none when n_l is 0), each paired with the next transfer batch
    (an empty one without a transfer set)."""
    order = torch.randperm(n_l, generator=gen) if n_l else None
    no_transfer = (xl[:0], yl[:0], xl[:0].float())
    for s in range(steps):
        li = order[s * batch_size : (s + 1) * batch_size] if n_l else slice(0, 0)
        yield (xl[li], yl[li]), (transfer.next() if transfer is not None else no_transfer)


def _step(
    student: nn.Module,
    opt: torch.optim.Optimizer,
    w: LossWeights,
    lr: float,
    labelled: tuple[torch.Tensor, torch.Tensor],
    transfer: tuple[torch.Tensor, ...],
) -> dict[str, float]:
    """One optimiser step on a labelled and a transfer batch (one forward pass over both); the loss and its terms."""
    (x_l, y_l), (x_t, teacher_logits, teacher_pooled) = labelled, transfer
    logits, pooled = logits_and_pooled(student, torch.cat([x_l, x_t]))
    k = len(x_l)
    for g in opt.param_groups:
        g["lr"] = lr
    loss, parts = distill_loss(
        w,
        labelled_logits=logits[:k],
        labels=y_l,
        transfer_logits=logits[k:],
        teacher_logits=teacher_logits,
        transfer_h=pooled[k:],
        teacher_h=teacher_pooled,
    )
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return {"loss": float(loss.detach()), **parts}


def _epoch_metrics(
    student: nn.Module,
    epoch: int,
    sums: dict[str, float],
    count: int,
    secs: float,
    val: tuple[np.ndarray, np.ndarray] | None,
) -> dict:
    """Mean training loss terms and speed of epoch `epoch` (0-based), plus val AUC / logloss when there is `val`."""
    metrics = {
        "epoch": epoch + 1,
        **{f"train_{k}": v / max(count, 1) for k, v in sums.items()},
        "steps_per_s": count / max(secs, 1e-9),
    }
    if val is not None and len(val[0]):
        p = predict(student, val[0])
        metrics.update(val_auc=auc(val[1], p), val_logloss=logloss(val[1], p))
    return metrics
