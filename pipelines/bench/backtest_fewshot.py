"""`python -m pipelines backtest --few-shot K`: new users after their first K labelled rows (issue 14).

The protocol of the issue's reference figure. The log is cut where the static benchmark cuts it
(`quality_protocol.temporal_split`); a *new* user has no row before the cut. Each new user's first K
rows after the cut are *revealed*: labelled rows the models may learn from. That user's later rows are
*scored*. Rows of users seen before the cut are neither. Every comparator scores exactly the scored rows:

* `lr_static`: the one-hot LR of `bench quality` fitted on the rows before the cut (C tuned as there);
* `lr_few_shot`: the same LR refitted on the rows before the cut plus the revealed rows (the issue's
  reference: 0.6932 -> 0.7174 for K = 10);
* `static`: the base trained on the rows before the cut (`base_training`, the config's `model`);
* `adapter_few_shot`: the static base plus one adapter that trains only the new users' id rows
  (`trainable_tokens: [user_id]`, `tokens_only`, the config's other `lora` settings) on all the revealed
  rows for `lora.epochs` epochs: what an adapter can learn about a new user from K rows. Every other
  id, and every weight of the base, scores as the base scores it.

This is a one-shot protocol, not a day-by-day one: the revealed rows of a user who arrives late come after
the scored rows of one who arrived early. That is the definition the reference figure uses.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import time

import numpy as np
import pandas as pd

from pipelines.bench import quality_protocol as qp
from pipelines.bench.backtest_models import fit_base, score
from pipelines.config import PipelineConfig
from pipelines.errors import ConfigError
from pipelines.metrics import auc

log = logging.getLogger(__name__)

COMPARATORS = ("lr_static", "lr_few_shot", "static", "adapter_few_shot")


def split(frame: pd.DataFrame, shots: int) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(rows before the cut, the revealed rows, the scored rows) for `shots` revealed rows per new user."""
    if shots < 1:
        raise ConfigError(f"backtest --few-shot: the number of revealed rows per new user must be >= 1, got {shots}")
    before, after = qp.temporal_split(frame, qp.TRAIN_FRACTION)
    new = after[~after["user_id"].isin(set(before["user_id"]))]
    rank = new.groupby("user_id", sort=False).cumcount()   # rows are in event order: 0 = the user's first
    return before, new[rank < shots], new[rank >= shots]


def run(cfg: PipelineConfig, frame: pd.DataFrame | None = None, *, shots: int = 10) -> dict:
    """AUC of every comparator on the scored rows, training CPU seconds, and the rows' counts."""
    if frame is None:
        from pipelines.data import movielens

        frame = movielens.load()
    before, revealed, scored = split(frame, shots)
    log.info("backtest --few-shot %d: %d rows before the cut, %d new users, %d revealed rows, %d scored rows",
             shots, len(before), revealed["user_id"].nunique(), len(revealed), len(scored))
    y = scored["label"].to_numpy().astype(np.int64)
    out: dict = {"mode": "few_shot", "shots": shots, "rows": int(len(scored)), "revealed_rows": int(len(revealed)),
                 "new_users": int(revealed["user_id"].nunique())}
    preds, cpu = {}, {}

    t = time.process_time()
    fit, val = qp.temporal_split(before, 1.0 - qp.VAL_FRACTION)
    C, _ = qp.tune_lr(fit, val)
    preds["lr_static"] = qp.predict_lr(qp.fit_lr(before, C), scored)
    preds["lr_few_shot"] = qp.predict_lr(qp.fit_lr(pd.concat([before, revealed]), C), scored)
    cpu["lr"] = time.process_time() - t

    t = time.process_time()
    base = fit_base(cfg, before, "few-shot-static")
    cpu["static"] = time.process_time() - t
    preds["static"] = score(base, cfg, scored)
    t = time.process_time()
    adapted = _user_rows_adapter(cfg, base, revealed)
    cpu["adapter_few_shot"] = time.process_time() - t
    preds["adapter_few_shot"] = score(adapted, cfg, scored)

    for name in COMPARATORS:
        out[f"{name}_auc"] = round(float(auc(y, preds[name])), 4)
    out.update({"lr_C": C, "static_cpu_s": round(cpu["static"], 1),
                "adapter_few_shot_cpu_s": round(cpu["adapter_few_shot"], 1), "lr_cpu_s": round(cpu["lr"], 1)})
    return out


def _user_rows_adapter(cfg: PipelineConfig, base, revealed: pd.DataFrame):
    """The base with the revealed users' id rows trained on all their revealed rows, `lora.epochs`
    epochs. No rows are kept back to validate: a user whose rows all fell in them would learn nothing."""
    from pipelines.model import adapters, family, features
    from pipelines.training.loop import LoopSettings, seed_everything, train

    lc = dataclasses.replace(cfg.lora, trainable_tokens=("user_id",), tokens_only=True)
    seed_everything(lc.seed)
    model = adapters.attach(copy.deepcopy(base), lc,
                            token_rows={"user_id": features.id_buckets(revealed["user_id"], "user_id", cfg.model)})
    settings = LoopSettings(lc.epochs, lc.batch_size, lc.stable_lr(), lc.weight_decay, lc.warmup_steps, lc.seed)
    train(model, family.encode(revealed, cfg.model), features.labels(revealed), settings, desc="few-shot-user-rows")
    return model.eval()


def table(r: dict) -> str:
    lines = [f"backtest --few-shot {r['shots']}: {r['rows']} scored rows of {r['new_users']} new users "
             f"({r['revealed_rows']} revealed rows)", "", "| comparator | AUC |", "|---|---|"]
    lines += [f"| {n} | {r[f'{n}_auc']} |" for n in COMPARATORS]
    return "\n".join(lines)
