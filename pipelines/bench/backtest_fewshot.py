"""`python -m pipelines backtest --few-shot K`: new users after their first K labelled rows (issue 14).

The protocol of the issue's reference figure. The log is cut where the static benchmark cuts it
(`backtest_protocol.temporal_split`); a *new* user has no row before the cut. Each new user's first K
rows after the cut are *revealed*: labelled rows the models may learn from. That user's later rows are
*scored*. Rows of users seen before the cut are neither. Every comparator scores exactly the scored rows:

* `lr_static`: the one-hot LR of the backtest (`backtest_lr`) fitted on the rows before the cut (C tuned as there);
* `lr_few_shot`: the same LR refitted on the rows before the cut plus the revealed rows (the issue's
  reference: 0.6932 -> 0.7174 for K = 10);
* `static`: the base trained on the rows before the cut (`base_training`, the config's `model`);
* `adapter_few_shot`: the static base plus one adapter of the shipped kind (the config's `lora`: a `delta`
  moves the wide rows of the revealed rows' users and items, a LoRA recipe with `trainable_tokens` those
  tables' rows) trained on all the revealed rows for `lora.epochs` epochs: what the adapter the pipeline
  ships can learn about a new user from K rows.

This is a one-shot protocol, not a day-by-day one: the revealed rows of a user who arrives late come after
the scored rows of one who arrived early. That is the definition the reference figure uses.

`cut="validation"` applies the same protocol to the rows before the test cut alone (cut again at its own
80%): new users of the validation period, to choose a recipe on; `cut="test"` (the default) is the
reference protocol, which chooses nothing.
"""

from __future__ import annotations

import copy
import logging
import time

import numpy as np
import pandas as pd

from pipelines.bench.backtest_lr import fit_lr, predict_lr, tune_lr
from pipelines.bench.backtest_models import fit_base, score
from pipelines.bench.backtest_protocol import TRAIN_FRACTION, VAL_FRACTION, temporal_split
from pipelines.config import PipelineConfig
from pipelines.data import movielens
from pipelines.errors import ConfigError
from pipelines.metrics import auc
from pipelines.model import adapters, family, features
from pipelines.training import delta
from pipelines.training.loop import seed_everything, train

log = logging.getLogger(__name__)

COMPARATORS = ("lr_static", "lr_few_shot", "static", "adapter_few_shot")


def split(frame: pd.DataFrame, shots: int) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(rows before the cut, the revealed rows, the scored rows) for `shots` revealed rows per new user."""
    if shots < 1:
        raise ConfigError(f"backtest --few-shot: the number of revealed rows per new user must be >= 1, got {shots}")
    before, after = temporal_split(frame, TRAIN_FRACTION)
    new = after[~after["user_id"].isin(set(before["user_id"]))]
    rank = new.groupby("user_id", sort=False).cumcount()  # rows are in event order: 0 = the user's first
    return before, new[rank < shots], new[rank >= shots]


CUTS = ("test", "validation")


def run(cfg: PipelineConfig, frame: pd.DataFrame | None = None, *, shots: int = 10, cut: str = "test") -> dict:
    """AUC of every comparator on the scored rows, training CPU seconds, and the rows' counts."""
    if cut not in CUTS:
        raise ConfigError(f"backtest --few-shot: --cut must be one of {list(CUTS)}, got {cut!r}")
    if frame is None:
        frame = movielens.load()
    if cut == "validation":  # the rows before the test period only
        frame = temporal_split(frame, TRAIN_FRACTION)[0]
    before, revealed, scored = split(frame, shots)
    log.info(
        "backtest --few-shot %d: %d rows before the cut, %d new users, %d revealed rows, %d scored rows",
        shots,
        len(before),
        revealed["user_id"].nunique(),
        len(revealed),
        len(scored),
    )
    y = scored["label"].to_numpy().astype(np.int64)
    out: dict = {
        "mode": "few_shot",
        "cut": cut,
        "shots": shots,
        "adapter_kind": cfg.lora.kind,
        "rows": int(len(scored)),
        "revealed_rows": int(len(revealed)),
        "new_users": int(revealed["user_id"].nunique()),
    }
    preds, cpu = {}, {}

    t = time.process_time()
    fit, val = temporal_split(before, 1.0 - VAL_FRACTION)
    C, _ = tune_lr(fit, val)
    preds["lr_static"] = predict_lr(fit_lr(before, C), scored)
    preds["lr_few_shot"] = predict_lr(fit_lr(pd.concat([before, revealed]), C), scored)
    cpu["lr"] = time.process_time() - t

    t = time.process_time()
    base = fit_base(cfg, before, "few-shot-static")
    cpu["static"] = time.process_time() - t
    preds["static"] = score(base, cfg, scored)
    t = time.process_time()
    adapted = _shipped_adapter(cfg, base, revealed)
    cpu["adapter_few_shot"] = time.process_time() - t
    preds["adapter_few_shot"] = score(adapted, cfg, scored)

    for name in COMPARATORS:
        out[f"{name}_auc"] = round(float(auc(y, preds[name])), 4)
    out.update(
        {
            "lr_C": C,
            "static_cpu_s": round(cpu["static"], 1),
            "adapter_few_shot_cpu_s": round(cpu["adapter_few_shot"], 1),
            "lr_cpu_s": round(cpu["lr"], 1),
        }
    )
    return out


def _shipped_adapter(cfg: PipelineConfig, base, revealed: pd.DataFrame):
    """The base with an adapter of the config's `lora` trained on all the revealed rows, `lora.epochs` epochs
    (the id rows of its `trainable_tokens`: those of the revealed rows' ids). No rows are kept back to
    validate: a user whose rows all fell in them would learn nothing."""
    lc = cfg.lora
    rows = {t: features.id_buckets(revealed[t], t, cfg.model) for t in lc.trainable_tokens} or None
    seed_everything(lc.seed)
    model = adapters.attach(copy.deepcopy(base), lc, token_rows=rows)
    train(
        model,
        family.encode(revealed, cfg.model),
        features.labels(revealed),
        delta.loop_settings(lc),
        desc="few-shot-adapter",
        regularizer=delta.regularizer(lc, len(revealed)),
    )
    return model.eval()


def table(r: dict) -> str:
    lines = [
        f"backtest --few-shot {r['shots']} ({r['cut']} cut, adapter kind {r['adapter_kind']}): {r['rows']} scored "
        f"rows of {r['new_users']} new users ({r['revealed_rows']} revealed rows)",
        "",
        "| comparator | AUC |",
        "|---|---|",
    ]
    lines += [f"| {n} | {r[f'{n}_auc']} |" for n in COMPARATORS]
    return "\n".join(lines)
