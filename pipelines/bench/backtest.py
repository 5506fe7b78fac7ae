"""`python -m pipelines backtest`: what daily models are worth on real data, day by day (issue 14).

Every comparator of `backtest_models` scores each scored day of `backtest_protocol` (MovieLens-100K,
test-then-train) with models fitted only on earlier rows; the result is one JSON-safe dict: AUC overall
and on warm / cold-at-scoring rows per comparator, training CPU seconds, adapter bytes, the share of
full retraining's gain the id adapters capture and at what share of its cost, and a row per day.

`full_retrain` (a base trained from scratch every day: the slow one) runs in a second process while
this one runs the others, each process on one torch thread.
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import multiprocessing
import time

import numpy as np

from pipelines.bench import backtest_models as bm
from pipelines.bench.backtest_protocol import Backtest, build, summary
from pipelines.config import PipelineConfig
from pipelines.errors import ConfigError

log = logging.getLogger(__name__)

COMPARATORS = ("static", "adapter", "adapter_ids", "full_retrain", "lr_daily")


def comparators(cfg: PipelineConfig, names=COMPARATORS, *, ids_per_slot: bool = True) -> dict[str, bm.Comparator]:
    """The comparators `names` (a subset of COMPARATORS), in the order they run; the adapters share
    the static base, which is trained once whether or not `static` itself is reported. `ids_per_slot`
    False: one `adapter_ids` adapter a day for every slot, on all the window's rows (a diagnostic: the
    pipeline trains adapters per slot)."""
    unknown = sorted(set(names) - set(COMPARATORS))
    if unknown:
        raise ConfigError(f"backtest: unknown comparators {unknown}; choose from {list(COMPARATORS)}")
    static = bm.Static(cfg)
    made = {"static": static,
            "adapter": bm.SlotAdapters("adapter", cfg, bm.lora_only_config(cfg.lora), static),
            "adapter_ids": bm.SlotAdapters("adapter_ids", cfg, bm.id_token_config(cfg.lora), static,
                                           per_slot=ids_per_slot),
            "full_retrain": bm.FullRetrain(cfg),
            "lr_daily": bm.LrDaily()}
    return {n: made[n] for n in COMPARATORS if n in names}


def run(cfg: PipelineConfig, frame=None, *, day_from: str | None = None, day_to: str | None = None,
        max_days: int | None = None, names=COMPARATORS, parallel: bool = True, ids_per_slot: bool = True) -> dict:
    """Replay the scored days of `frame` (default: MovieLens-100K) for the comparators `names`."""
    if frame is None:
        from pipelines.data import movielens

        frame = movielens.load()
    bt = build(frame, day_from, day_to, max_days)
    models = comparators(cfg, names, ids_per_slot=ids_per_slot)
    log.info("backtest: %d days %s..%s, %d scored rows (%d warm), comparators %s", len(bt.days), bt.days[0].date,
             bt.days[-1].date, bt.last - bt.first, int(bt.warm[bt.first:bt.last].sum()), list(models))
    t0 = time.perf_counter()
    child = models.pop("full_retrain", None) if parallel else None
    second = cf.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) if child else None
    with second or contextlib.nullcontext() as pool:
        remote = pool.submit(_replay_alone, child, bt) if child else None
        preds = _replay(models, bt)
        if remote is not None:
            preds["full_retrain"], models["full_retrain"] = remote.result()
    return _result(bt, models, preds, time.perf_counter() - t0)


def _replay(models: dict[str, bm.Comparator], bt: Backtest) -> dict[str, np.ndarray]:
    """Every comparator's scores of every scored row, day by day (test, then the next day's training)."""
    preds = {n: np.full(bt.last - bt.first, np.nan) for n in models}
    y = bt.labels()
    for k, day in enumerate(bt.days):
        at = slice(day.start - bt.first, day.stop - bt.first)
        for name, model in models.items():
            preds[name][at] = model.predict_day(bt, day)
        done = slice(0, day.stop - bt.first)
        so_far = {n: summary(y[done], p[done], bt.warm[bt.first:day.stop])["auc"] for n, p in preds.items()}
        log.info("backtest day %d/%d %s (%d rows): AUC so far %s", k + 1, len(bt.days), day.date, day.rows,
                 ", ".join(f"{n} {a}" for n, a in so_far.items()))
    return preds


def _replay_alone(model: bm.Comparator, bt: Backtest) -> tuple[np.ndarray, bm.Comparator]:
    """`_replay` of one comparator (the body of the second process)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    return _replay({model.name: model}, bt)[model.name], model


def _result(bt: Backtest, models: dict[str, bm.Comparator], preds: dict[str, np.ndarray], wall_s: float) -> dict:
    y, warm = bt.labels(), bt.warm[bt.first:bt.last]
    out: dict = {"from": bt.days[0].date, "to": bt.days[-1].date, "days": len(bt.days), "rows": int(len(y)),
                 "warm_rows": int(warm.sum()), "cold_rows": int((~warm).sum())}
    for name in COMPARATORS:
        if name not in preds:
            continue
        s = summary(y, preds[name], warm)
        out.update({f"{name}_auc": s["auc"], f"{name}_auc_warm": s["auc_warm"], f"{name}_auc_cold": s["auc_cold"],
                    f"{name}_cpu_s": round(models[name].cpu_s, 1)})
    for name in ("adapter", "adapter_ids"):
        if name in models:
            out[f"{name}_bytes"] = models[name].info()["adapter_bytes"]
    out.update(_goals(out))
    out["per_day"] = _per_day(bt, preds)
    out["comparators"] = {n: m.info() for n, m in models.items() if m.info()}
    out["wall_s"] = round(wall_s, 1)
    return out


def _goals(r: dict) -> dict:
    """The issue's ratios: the share of full retraining's AUC gain over static the id adapters capture, and
    their training cost as a share of full retraining's."""
    out = {}
    if all(r.get(k) is not None for k in ("adapter_ids_auc", "full_retrain_auc", "static_auc")):
        gain = r["full_retrain_auc"] - r["static_auc"]
        out["adapter_ids_gain_share"] = round((r["adapter_ids_auc"] - r["static_auc"]) / gain, 3) if gain else None
    if r.get("adapter_ids_cpu_s") is not None and r.get("full_retrain_cpu_s"):
        out["adapter_ids_cost_share"] = round(r["adapter_ids_cpu_s"] / r["full_retrain_cpu_s"], 3)
    return out


def _per_day(bt: Backtest, preds: dict[str, np.ndarray]) -> list[dict]:
    """Per day: its rows, warm rows, each comparator's AUC on the day (`<name>`) and on every row scored
    so far (`cum_<name>`)."""
    y, warm = bt.labels(), bt.warm[bt.first:bt.last]
    rows = []
    for day in bt.days:
        at = slice(day.start - bt.first, day.stop - bt.first)
        upto = slice(0, day.stop - bt.first)
        rows.append({"date": day.date, "rows": day.rows, "warm_rows": int(warm[at].sum()),
                     **{n: summary(y[at], p[at], warm[at])["auc"] for n, p in preds.items()},
                     **{f"cum_{n}": summary(y[upto], p[upto], warm[upto])["auc"] for n, p in preds.items()}})
    return rows


def table(r: dict) -> str:
    """The result as a small markdown table (the CLI's output without --json)."""
    lines = [f"backtest {r['from']}..{r['to']}: {r['days']} days, {r['rows']} rows "
             f"({r['warm_rows']} warm, {r['cold_rows']} cold at scoring)", "",
             "| comparator | AUC | AUC warm | AUC cold | training CPU s |", "|---|---|---|---|---|"]
    for name in COMPARATORS:
        if f"{name}_auc" in r:
            lines.append(f"| {name} | {r[f'{name}_auc']} | {r[f'{name}_auc_warm']} | {r[f'{name}_auc_cold']} | "
                         f"{r[f'{name}_cpu_s']} |")
    return "\n".join(lines)
