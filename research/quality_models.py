"""The two CTRModel rows of `research.quality`: how they are trained and selected.

* ``base``: a CTRModel trained on every parameter (`train_base`), its configuration and stopping
  epoch chosen on the validation split over `BASE_GRID` (`tune_base`);
* ``lora``: that base + one LoRA adapter per slot (`slot_adapters`), each trained on its slot's rows
  and scoring its slot's rows, its number of epochs chosen on validation.

What is measured of them (the split, the metrics) is in `research.quality_protocol`.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from pipelines.config import LoraTrainConfig, ModelConfig
from pipelines.metrics import auc
from pipelines.model import adapters, features, store
from pipelines.model.base import CTRModel
from pipelines.model.inference import predict
from pipelines.training.loop import LoopSettings
from pipelines.training.loop import train as loop_train
from research.quality_protocol import SEED, tokens


@dataclass(frozen=True)
class BaseCandidate:
    """One point of the base-model search: model config, optimiser settings, max epochs (the epoch
    to stop at is chosen on validation too), and the fields replaced by a constant token."""

    model: ModelConfig = field(default_factory=ModelConfig)
    lr: float = 3e-3
    weight_decay: float = 1e-4
    batch_size: int = 512
    max_epochs: int = 4
    warmup_steps: int = 20
    drop_fields: tuple[str, ...] = ()

    def describe(self) -> dict:
        m = self.model
        return {
            "embed_dim": m.embed_dim,
            "n_blocks": m.n_blocks,
            "dropout": m.dropout,
            "id_buckets": m.id_buckets,
            "small_buckets": m.small_buckets,
            "wide": m.wide,
            "lr": self.lr,
            "weight_decay": self.weight_decay,
            "batch_size": self.batch_size,
            "max_epochs": self.max_epochs,
            "drop_fields": list(self.drop_fields),
        }


# The search grid, each point scored per epoch on the validation split. It is the short list kept from
# a wider exploration on the same validation split (never on test): embed_dim 8/16/32, dropout
# 0/0.3/0.5, lr 1e-3/3e-3/1e-2, weight decay 1e-4/0.1/0.5, batch 256/512/2048, 1 or 2 blocks, bigger
# hash tables (small_buckets 1024, id_buckets 2**16/2**18), dropping hour/weekday/slot. What mattered:
# dropping hour and weekday (+0.003-0.004 val AUC: under a temporal split they mostly identify rating
# sessions of training users, and they lower the LR's validation AUC too), dropout, embed_dim 16, and
# stopping after 1-2 epochs (validation AUC falls after that). The rest moved it by less than the
# seed-to-seed spread (about +-0.003), or down.
# Then, with the first-order term (ModelConfig.wide: per-field-value biases, what the LR learns),
# same split: wide + embed 8 / dropout 0.3: 0.7170 (without: 0.7141); with batch 2048, lr 1e-2:
# 0.7178 (epoch 3); wide with dropout 0.5 0.7147, lr 1e-3 0.7028, 1 block 0.6995, weight decay 0.1
# 0.7168, embed 16 0.7090; an FM second-order term on top 0.7108; zero-initialised id tables
# 0.7138-0.7166; scaling the wide tables' output x3/x10 (a higher lr for the biases) 0.7163/0.7138.
# The seed-to-seed spread of one configuration is larger than these differences (0.708-0.718 over 3
# seeds for wide + batch 2048); LR on the same split: 0.7195 (C=0.3).
_HW = ("hour", "weekday")
BASE_GRID: tuple[BaseCandidate, ...] = (
    BaseCandidate(),  # the pipeline's defaults
    BaseCandidate(model=ModelConfig(embed_dim=16, dropout=0.3), drop_fields=_HW),
    BaseCandidate(model=ModelConfig(embed_dim=16, dropout=0.5), drop_fields=_HW),
    BaseCandidate(model=ModelConfig(embed_dim=16, dropout=0.3), drop_fields=_HW, lr=1e-3),
    BaseCandidate(model=ModelConfig(embed_dim=8, dropout=0.3), drop_fields=_HW),
    BaseCandidate(model=ModelConfig(embed_dim=8, dropout=0.3, wide=True), drop_fields=_HW),
    BaseCandidate(
        model=ModelConfig(embed_dim=8, dropout=0.3, wide=True), drop_fields=_HW, batch_size=2048, lr=1e-2, max_epochs=6
    ),
)
LORA_MAX_EPOCHS = 3


class _Stop(Exception):
    """Raised from an on_epoch callback to end loop.train after the epoch we want."""


def _train(model, x: np.ndarray, y: np.ndarray, settings, desc: str, on_epoch) -> None:
    """`pipelines.training.loop.train`, ended early when `on_epoch` raises _Stop; the lr schedule is
    the one of `settings.epochs`, so a model stopped at epoch k is the one validation saw at epoch k."""
    try:
        loop_train(model, x, y, settings, desc=desc, on_epoch=on_epoch)
    except _Stop:
        pass


# ---------------------------------------------------------------------------------- base model
def train_base(
    cand: BaseCandidate,
    train: pd.DataFrame,
    val: pd.DataFrame | None = None,
    stop_epoch: int | None = None,
    seed: int = SEED,
):
    """Train a CTRModel on `train` under `cand` (cosine schedule over cand.max_epochs).

    With `val`: every epoch is scored on `val` and the weights of the best epoch are returned with
    the per-epoch validation AUCs. With `stop_epoch`: training ends after that epoch (same schedule, so
    a refit reproduces the point selected on validation). Returns (model in eval mode, val AUCs).
    """
    torch.manual_seed(seed)
    model = CTRModel(cand.model)
    x, y = tokens(train, cand.model, cand.drop_fields), features.labels(train)
    xv = tokens(val, cand.model, cand.drop_fields) if val is not None else None
    yv = features.labels(val) if val is not None else None
    best: dict = {}
    curve: list[float] = []

    def on_epoch(m: dict) -> None:
        if xv is not None:
            curve.append(auc(yv, predict(model, xv)))
            if "auc" not in best or curve[-1] > best["auc"]:
                best.update(auc=curve[-1], weights=copy.deepcopy(model.state_dict()))
        if stop_epoch is not None and m["epoch"] >= stop_epoch:
            raise _Stop

    settings = LoopSettings(
        epochs=cand.max_epochs,
        batch_size=cand.batch_size,
        lr=cand.lr,
        weight_decay=cand.weight_decay,
        warmup_steps=cand.warmup_steps,
        seed=seed,
    )
    _train(model, x, y, settings, "bench-base", on_epoch)
    if "weights" in best:
        model.load_state_dict(best["weights"])
    return model.eval(), curve


def predict_base(model, cand: BaseCandidate, frame: pd.DataFrame) -> np.ndarray:
    return predict(model, tokens(frame, cand.model, cand.drop_fields))


def tune_base(fit: pd.DataFrame, val: pd.DataFrame, grid=BASE_GRID, log: list | None = None):
    """Best (candidate, epoch, val AUC, fit-trained model at that epoch) over `grid` x epochs."""
    best = None
    for i, cand in enumerate(grid):
        t = time.perf_counter()
        model, curve = train_base(cand, fit, val=val)
        k = int(np.nanargmax(curve))
        if log is not None:
            log.append(
                {
                    "candidate": i,
                    **cand.describe(),
                    "val_auc_per_epoch": [round(a, 4) for a in curve],
                    "secs": round(time.perf_counter() - t, 1),
                }
            )
        if best is None or curve[k] > best[2]:
            best = (cand, k + 1, curve[k], model)
    return best


# ------------------------------------------------------------------------------ LoRA per slot
def slot_adapters(
    base_dir: Path,
    cand: BaseCandidate,
    train: pd.DataFrame,
    test: pd.DataFrame,
    lcfg: LoraTrainConfig,
    epochs_by_slot: dict[str, int] | None = None,
    max_epochs: int = LORA_MAX_EPOCHS,
    seed: int = SEED,
) -> tuple[np.ndarray, dict]:
    """One adapter per slot, each on a fresh copy of the base saved in `base_dir`, trained on the
    slot's `train` rows; returns (pCTR for every row of `test`, in order, each row scored by its
    slot's adapter; per-slot info).

    Selection mode (`epochs_by_slot` None; pass validation rows as `test`): each adapter trains
    `max_epochs` and keeps the epoch with the best AUC on its slot's rows, reported as info[slot]
    ["epoch"]. Scoring mode: each adapter stops after its given epoch (same lr schedule).
    A slot with fewer than `lcfg.min_rows` train rows gets no adapter (as in the pipeline): the base
    scores it.
    """
    out = np.full(len(test), np.nan)
    info: dict = {}
    for slot in sorted(set(test["slot"])):
        tr_rows = train[train["slot"] == slot]
        te_idx = np.flatnonzero((test["slot"] == slot).to_numpy())
        te_rows = test.iloc[te_idx]
        base = store.load_base(base_dir)
        if len(tr_rows) < lcfg.min_rows:
            out[te_idx] = predict(base, tokens(te_rows, cand.model, cand.drop_fields))
            info[slot] = {"epoch": 0, "train_rows": len(tr_rows)}
            continue
        stop_epoch = None if epochs_by_slot is None else epochs_by_slot[slot]
        out[te_idx], info[slot] = _slot_adapter(base, cand, slot, tr_rows, te_rows, lcfg, stop_epoch, max_epochs, seed)
    return out, info


def _slot_adapter(
    base,
    cand: BaseCandidate,
    slot: str,
    tr_rows: pd.DataFrame,
    te_rows: pd.DataFrame,
    lcfg: LoraTrainConfig,
    stop_epoch: int | None,
    max_epochs: int,
    seed: int,
) -> tuple[np.ndarray, dict]:
    """Attach one adapter to `base`, train it on `tr_rows`; (pCTR of `te_rows`, info). `stop_epoch`
    None is selection mode: train `max_epochs`, keep the predictions of the epoch with the best AUC
    on `te_rows`."""
    model = adapters.attach(base, lcfg)
    x_tr, y_tr = tokens(tr_rows, cand.model, cand.drop_fields), features.labels(tr_rows)
    x_te, y_te = tokens(te_rows, cand.model, cand.drop_fields), features.labels(te_rows)
    select = stop_epoch is None
    stop = max_epochs if select else stop_epoch
    best: dict = {}
    curve: list[float] = []

    def on_epoch(m: dict) -> None:
        if select:
            p = predict(model, x_te)
            curve.append(auc(y_te, p))
            if "auc" not in best or curve[-1] > best["auc"]:
                best.update(auc=curve[-1], epoch=m["epoch"], p=p)
        if m["epoch"] >= stop:
            raise _Stop

    # the lr the pipeline trains adapters with (LoraTrainConfig.stable_lr, where the config has it)
    lr = lcfg.stable_lr() if hasattr(lcfg, "stable_lr") else lcfg.lr
    settings = LoopSettings(
        epochs=max_epochs,
        batch_size=lcfg.batch_size,
        lr=lr,
        weight_decay=lcfg.weight_decay,
        warmup_steps=lcfg.warmup_steps,
        seed=seed,
    )
    _train(model, x_tr, y_tr, settings, f"bench-lora-{slot}", on_epoch)
    if select:
        return best["p"], {
            "epoch": best["epoch"],
            "train_rows": len(tr_rows),
            "auc_per_epoch": [round(a, 4) for a in curve],
        }
    return predict(model, x_te), {"epoch": stop, "train_rows": len(tr_rows)}
