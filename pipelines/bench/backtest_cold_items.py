"""`python -m pipelines backtest --cold-items K`: every scored row scored by a base that never saw its item.

The replay's new-item rows (items first rated in the test period) are what a family reading the item's
words is for, but MovieLens-100K has 202 of them on the test days: a paired AUC difference there has a
95% interval of about ±0.1, so no goal of a hundredth can be decided on them (`backtest_scores`). This
protocol asks the same question of every scored row. The items of the scored rows are split into K folds
by a hash of the item id; for each fold a static base (`backtest_models.fit_base`, the config's family
and `base_training`) is fitted on the history of the first scored day *without any row of the fold's
items*, and scores the scored rows of those items. So each of the scored rows is scored, once, by a
model that has never seen its item, yet has seen everything else the static base of the replay sees (the
same users, the same days before the cut): the classic item cold-start split, kept in time order.

The rows, warm/cold and new-item flags are the replay's (`backtest_protocol.build`), so a `--scores` file
pairs with another family's in `backtest-compare`, which refuses to pair it with a replay's file. Each
fold's base is cached like the replay's (`--base-cache`: its history is another, so is its key).
"""

from __future__ import annotations

import hashlib
import logging
import time

import numpy as np
import pandas as pd

from pipelines.bench import backtest_scores
from pipelines.bench.backtest_models import cached_base, score
from pipelines.bench.backtest_protocol import Backtest, build, summary
from pipelines.config import PipelineConfig
from pipelines.data import movielens
from pipelines.errors import ConfigError

log = logging.getLogger(__name__)

PROTOCOL = "cold_items"


def fold_of(items: pd.Series, folds: int) -> np.ndarray:
    """Each item id's fold in 0..folds-1: a hash of its text, so the same on every run and machine. Pure."""
    if folds < 2:
        raise ConfigError(f"backtest --cold-items: the number of item folds must be >= 2, got {folds}")
    return np.array([int(hashlib.sha256(str(i).encode()).hexdigest()[:15], 16) % folds for i in items], dtype=np.int64)


def split(bt: Backtest, folds: int) -> list[tuple[pd.DataFrame, np.ndarray]]:
    """Per fold: (the rows its base trains on, a mask of the scored rows it scores). The training rows are the
    history of the first scored day less every row of the fold's items; every scored row is in one mask. Pure."""
    history = bt.history(bt.days[0])
    scored_items = bt.frame["item_id"].iloc[bt.first : bt.last]
    scored_fold = fold_of(scored_items, folds)
    # only the fold's scored items are held out: an item with no scored row is nobody's test item
    return [
        (history[~history["item_id"].isin(set(scored_items[scored_fold == k])).to_numpy()], scored_fold == k)
        for k in range(folds)
    ]


def run(
    cfg: PipelineConfig,
    frame: pd.DataFrame | None = None,
    *,
    folds: int = 5,
    day_from: str | None = None,
    day_to: str | None = None,
    max_days: int | None = None,
    base_cache: str | None = None,
    scores: str | None = None,
) -> dict:
    """The protocol above on the replay's scored days (`backtest_protocol.build`'s range arguments): AUC of
    the `static` comparator overall / warm / cold / new items, each fold's base, and with `scores` the
    scores file (`backtest_scores.write`, protocol `cold_items`)."""
    if frame is None:
        frame = movielens.load()
    bt = build(frame, day_from, day_to, max_days)
    parts = split(bt, folds)  # a bad fold count fails here, before any base is fitted
    scored, y, warm = bt.frame.iloc[bt.first : bt.last], bt.labels(), bt.warm[bt.first : bt.last]
    log.info(
        "backtest --cold-items %d: %d days %s..%s, %d scored rows of %d items",
        folds,
        len(bt.days),
        bt.days[0].date,
        bt.days[-1].date,
        len(scored),
        scored["item_id"].nunique(),
    )
    t0 = time.perf_counter()
    preds = np.full(len(scored), np.nan)
    per_fold, cpu = [], 0.0
    for k, (train_rows, mask) in enumerate(parts):
        if not mask.any():  # more folds than scored items: this fold has nothing to score, so no base
            per_fold.append(
                {
                    "fold": k,
                    "items": 0,
                    "train_rows": int(len(train_rows)),
                    "scored_rows": 0,
                    "auc": None,
                    "cpu_s": 0.0,
                    "base_loaded_from": None,
                }
            )
            continue
        t = time.process_time()
        model, loaded = cached_base(cfg, train_rows, base_cache, f"cold-items-{k + 1}/{folds}")
        fit_s = 0.0 if loaded else time.process_time() - t
        cpu += fit_s
        preds[mask] = score(model, cfg, scored[mask])
        per_fold.append(
            {
                "fold": k,
                "items": int(scored["item_id"][mask].nunique()),
                "train_rows": int(len(train_rows)),
                "scored_rows": int(mask.sum()),
                "auc": summary(y[mask], preds[mask], warm[mask])["auc"],
                "cpu_s": round(fit_s, 1),
                "base_loaded_from": loaded,
            }
        )
        log.info(
            "backtest --cold-items: fold %d/%d: %d scored rows, AUC %s", k + 1, folds, mask.sum(), per_fold[-1]["auc"]
        )
    out = _result(cfg, bt, folds, preds, per_fold, cpu, time.perf_counter() - t0)
    if scores:
        out["scores"] = backtest_scores.write(
            scores, bt, {"static": preds}, {k: out[k] for k in ("model_family", "from", "to", "protocol", "folds")}
        )
    return out


def _result(
    cfg: PipelineConfig, bt: Backtest, folds: int, preds: np.ndarray, per_fold: list[dict], cpu: float, wall_s: float
) -> dict:
    warm, new_item = bt.warm[bt.first : bt.last], bt.new_item[bt.first : bt.last]
    s = summary(bt.labels(), preds, warm, new_item)
    return {
        "protocol": PROTOCOL,
        "model_family": cfg.model.family,
        "folds": folds,
        "from": bt.days[0].date,
        "to": bt.days[-1].date,
        "days": len(bt.days),
        "rows": int(len(preds)),
        "warm_rows": int(warm.sum()),
        "cold_rows": int((~warm).sum()),
        "new_item_rows": int(new_item.sum()),
        "static_auc": s["auc"],
        "static_auc_warm": s["auc_warm"],
        "static_auc_cold": s["auc_cold"],
        "static_auc_new_item": s["auc_new_item"],
        "static_cpu_s": round(cpu, 1),
        "per_fold": per_fold,
        "wall_s": round(wall_s, 1),
    }


def table(r: dict) -> str:
    """The result as a small markdown table (the CLI's output without --json)."""
    lines = [
        f"backtest --cold-items {r['folds']} {r['from']}..{r['to']} (model family {r['model_family']}): "
        f"{r['rows']} rows, each scored by a base fitted without its item ({r['warm_rows']} warm, "
        f"{r['cold_rows']} cold at scoring, {r['new_item_rows']} of items new in the test period)",
        "",
        "| AUC | AUC warm | AUC cold | AUC new items | base CPU s |",
        "|---|---|---|---|---|",
        f"| {r['static_auc']} | {r['static_auc_warm']} | {r['static_auc_cold']} | {r['static_auc_new_item']} | "
        f"{r['static_cpu_s']} |",
        "",
        "| fold | items | training rows | scored rows | AUC |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {f['fold']} | {f['items']} | {f['train_rows']} | {f['scored_rows']} | {f['auc']} |" for f in r["per_fold"]
    ]
    return "\n".join(lines)
