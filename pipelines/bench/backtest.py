"""`python -m pipelines backtest`: what daily models are worth on real data, day by day (issue 14).

Every comparator of `backtest_models` scores each scored day of `backtest_protocol` (MovieLens-100K,
test-then-train) with models fitted only on earlier rows; the result is one JSON-safe dict: AUC overall
and on warm / cold-at-scoring rows per comparator, training CPU seconds, adapter bytes, the share of
full retraining's gain the id adapters capture and at what share of its cost, and a row per day.

`full_retrain` (a base trained from scratch every day: the slow one) runs in two more processes, every other
day each, and `served` in one of its own, while this one runs the others; each process on one torch thread.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import time

import numpy as np
import torch

from pipelines.bench import backtest_lr, backtest_scores
from pipelines.bench import backtest_models as bm
from pipelines.bench.backtest_protocol import Backtest, auc_within, build, summary
from pipelines.bench.backtest_served import Served
from pipelines.config import GatePolicy, PipelineConfig, load_gate_policy
from pipelines.data import movielens
from pipelines.errors import ConfigError

log = logging.getLogger(__name__)

COMPARATORS = (
    "static",
    "adapter",
    "adapter_lora",
    "adapter_ids",
    "full_retrain",
    "lr_static",
    "lr_daily",
    "lr_delta",
    "served",
)
# Each in a process of its own when `parallel`: the slow ones (full_retrain: a base a day; served: the
# pipeline's stages, MLflow included); the others run in this process meanwhile.
SEPARATE = ("full_retrain", "served")
# Comparators whose days are independent of each other (each fitted from scratch on its history): split
# over this many processes, every k-th day each, so the two cores are both busy to the end.
SHARDS = {"full_retrain": 2}
QUICK_DAYS = 7
# Scored by the `served` replay beside what it served (backtest_served): gating nothing, and never releasing.
POLICIES = ("always_release", "never_release")


def comparators(
    cfg: PipelineConfig,
    names=COMPARATORS,
    *,
    ids_per_slot: bool = True,
    policy: GatePolicy | None = None,
    served_dir: str | None = None,
    flip_labels: str | None = None,
    base_cache: str | None = None,
) -> dict[str, bm.Comparator]:
    """The comparators `names` (a subset of COMPARATORS), in the order they run; the adapters share
    the static base, which is trained once whether or not `static` itself is reported. `ids_per_slot`
    False: one `adapter_ids` adapter a day for every slot, on all the window's rows (a diagnostic: the
    pipeline trains adapters per slot). `served` replays the pipeline under `policy` (default: the gate
    policy file) in `served_dir` (default: a new temporary directory), `flip_labels` its injected fault.
    `base_cache`: a folder keeping the static base between replays (`backtest_models.Static`)."""
    _check_names(names)
    static = bm.Static(cfg, base_cache)
    made = {
        "static": static,
        "adapter": bm.SlotAdapters("adapter", cfg, cfg.lora, static, per_slot=cfg.lora.train_rows == "slot"),
        "adapter_lora": bm.SlotAdapters("adapter_lora", cfg, bm.lora_only_config(cfg.lora), static),
        "adapter_ids": bm.SlotAdapters("adapter_ids", cfg, bm.id_token_config(cfg.lora), static, per_slot=ids_per_slot),
        "full_retrain": bm.FullRetrain(cfg),
        "lr_static": backtest_lr.LrStatic(),
        "lr_daily": backtest_lr.LrDaily(),
        "lr_delta": backtest_lr.LrDelta(),
    }
    if "served" in names:
        made["served"] = Served(cfg, policy or load_gate_policy(), served_dir, flip_labels=flip_labels)
    return {n: made[n] for n in COMPARATORS if n in names}


def run(
    cfg: PipelineConfig,
    frame=None,
    *,
    day_from: str | None = None,
    day_to: str | None = None,
    max_days: int | None = None,
    names=COMPARATORS,
    parallel: bool = True,
    ids_per_slot: bool = True,
    quick: bool = False,
    base_cache: str | None = None,
    scores: str | None = None,
    **served,
) -> dict:
    """Replay the scored days of `frame` (default: MovieLens-100K) for the comparators `names`;
    `served`: `comparators`' policy, served_dir and flip_labels. `quick`: at most 7 days, and only the
    rows of the config's first slot (that slot alone in the config). `scores`: also write every scored
    row's scores to this parquet file (`backtest_scores`: what `backtest-compare` pairs)."""
    _check_names(names)  # before the data is read: a typo is a usage error at once
    _one_thread()
    if frame is None:
        frame = movielens.load()
    if quick:
        slot = cfg.data.slots[0]
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, slots=(slot,)))
        frame = frame[frame["slot"] == slot]
        max_days = min(max_days or QUICK_DAYS, QUICK_DAYS)
    bt = build(frame, day_from, day_to, max_days)
    models = comparators(cfg, names, ids_per_slot=ids_per_slot, base_cache=base_cache, **served)
    log.info(
        "backtest: %d days %s..%s, %d scored rows (%d warm), comparators %s",
        len(bt.days),
        bt.days[0].date,
        bt.days[-1].date,
        bt.last - bt.first,
        int(bt.warm[bt.first : bt.last].sum()),
        list(models),
    )
    t0 = time.perf_counter()
    alone = {n: models.pop(n) for n in SEPARATE if n in models} if parallel else {}
    jobs = [(n, m, bt.days[i :: SHARDS.get(n, 1)]) for n, m in alone.items() for i in range(SHARDS.get(n, 1))]
    others = cf.ProcessPoolExecutor(len(jobs), mp_context=multiprocessing.get_context("spawn")) if jobs else None
    with others or contextlib.nullcontext() as pool:
        remote = [(n, pool.submit(_replay_alone, m, bt, days)) for n, m, days in jobs]
        preds = replay(models, bt) if models else {}
        for n, future in remote:
            _merge(preds, models, n, *future.result())
    if "served" in models:
        preds.update(models["served"].policy_scores())
    out = {
        "model_family": cfg.model.family,
        "adapter_kind": cfg.lora.kind,
        **_result(bt, models, preds, time.perf_counter() - t0),
    }
    if scores:
        meta = {"protocol": "replay", **{k: out[k] for k in ("model_family", "from", "to")}}
        out["scores"] = backtest_scores.write(scores, bt, preds, meta)
    return out


def _check_names(names) -> None:
    unknown = sorted(set(names) - set(COMPARATORS))
    if unknown:
        raise ConfigError(f"backtest: unknown comparators {unknown}; choose from {list(COMPARATORS)}")


def replay(models: dict[str, bm.Comparator], bt: Backtest, days=None) -> dict[str, np.ndarray]:
    """Every comparator's scores of every scored row of `days` (default: every scored day), day by day
    (test, then the next day's training); the rows of other days stay NaN."""
    days = bt.days if days is None else days
    preds = {n: np.full(bt.last - bt.first, np.nan) for n in models}
    y, warm = bt.labels(), bt.warm[bt.first : bt.last]
    for k, day in enumerate(days):
        at = slice(day.start - bt.first, day.stop - bt.first)
        for name, model in models.items():
            preds[name][at] = model.predict_day(bt, day)
        done = ~np.isnan(next(iter(preds.values())))
        so_far = {n: summary(y[done], p[done], warm[done])["auc"] for n, p in preds.items()}
        log.info(
            "backtest day %d/%d %s (%d rows): AUC so far %s",
            k + 1,
            len(days),
            day.date,
            day.rows,
            ", ".join(f"{n} {a}" for n, a in so_far.items()),
        )
    return preds


def _replay_alone(model: bm.Comparator, bt: Backtest, days) -> tuple[np.ndarray, bm.Comparator]:
    """`replay` of one comparator on `days` (the body of another process)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    _one_thread()
    return replay({model.name: model}, bt, days)[model.name], model


def _one_thread() -> None:
    """Torch's intra-op threads (CTR_TORCH_THREADS, default 1) before the first fit, not at the first
    scoring: a fit's float sums depend on them, and the processes share two cores."""
    torch.set_num_threads(int(os.environ.get("CTR_TORCH_THREADS", "1")))


def _merge(preds: dict, models: dict, name: str, scores: np.ndarray, model: bm.Comparator) -> None:
    """A process's scores of `name` into `preds` (its days only) and its model into `models` (the CPU
    seconds of a comparator's shards add up)."""
    if name not in preds:
        preds[name], models[name] = scores, model
        return
    at = ~np.isnan(scores)
    preds[name][at] = scores[at]
    models[name].cpu_s += model.cpu_s


def _result(bt: Backtest, models: dict[str, bm.Comparator], preds: dict[str, np.ndarray], wall_s: float) -> dict:
    y, warm, new_item = bt.labels(), bt.warm[bt.first : bt.last], bt.new_item[bt.first : bt.last]
    groups = bt.slot_days()
    out: dict = {
        "from": bt.days[0].date,
        "to": bt.days[-1].date,
        "days": len(bt.days),
        "rows": int(len(y)),
        "warm_rows": int(warm.sum()),
        "cold_rows": int((~warm).sum()),
        "new_item_rows": int(new_item.sum()),
    }
    for name in (*COMPARATORS, *POLICIES):
        if name not in preds:
            continue
        s = summary(y, preds[name], warm, new_item)
        out.update(
            {
                f"{name}_auc": s["auc"],
                f"{name}_auc_warm": s["auc_warm"],
                f"{name}_auc_cold": s["auc_cold"],
                f"{name}_auc_new_item": s["auc_new_item"],
                f"{name}_auc_within_slot_day": auc_within(y, preds[name], groups),
            }
        )
        if name in models:  # a policy's models are the replay's: it costs no training of its own
            out[f"{name}_cpu_s"] = round(models[name].cpu_s, 1)
    for name in ("adapter", "adapter_lora", "adapter_ids"):
        if name in models:
            out[f"{name}_bytes"] = models[name].info()["adapter_bytes"]
    if "served" in models:
        served = models["served"].info()
        out.update(
            {
                k: served[k]
                for k in (
                    "gate_releases",
                    "gate_rejections",
                    "judge_waits",
                    "gate_held",
                    "canary_promotions",
                    "canary_withdrawals",
                    "reverts",
                    "days_not_validated",
                )
            }
        )
        out.update(gate_trust=served["trust"], gate_precision=served["gate_precision"], fault=served["fault"])
    out.update(_goals(out))
    out["per_day"] = _per_day(bt, preds)
    out["comparators"] = {n: m.info() for n, m in models.items() if m.info()}
    out["wall_s"] = round(wall_s, 1)
    return out


def _goals(r: dict) -> dict:
    """The issues' ratios: the share of full retraining's AUC gain over static the shipped adapter (and the id
    adapters) capture, and their training cost as a share of full retraining's."""
    out = {}
    for name in ("adapter", "adapter_ids"):  # the shipped adapter, and issue 14's id rows
        if all(r.get(k) is not None for k in (f"{name}_auc", "full_retrain_auc", "static_auc")):
            gain = r["full_retrain_auc"] - r["static_auc"]
            out[f"{name}_gain_share"] = round((r[f"{name}_auc"] - r["static_auc"]) / gain, 3) if gain else None
        if r.get(f"{name}_cpu_s") is not None and r.get("full_retrain_cpu_s"):
            out[f"{name}_cost_share"] = round(r[f"{name}_cpu_s"] / r["full_retrain_cpu_s"], 3)
    daily = {
        n: r[f"{n}_auc"]
        for n in ("adapter", "adapter_lora", "adapter_ids", "full_retrain", "lr_daily", "lr_delta")
        if r.get(f"{n}_auc") is not None
    }
    if r.get("served_auc") is not None and daily:
        best = max(daily, key=daily.get)
        out.update(served_best_daily=best, served_minus_best_daily=round(r["served_auc"] - daily[best], 4))
    if r.get("served_auc") is not None:
        out.update(
            {
                f"served_minus_{p}": round(r["served_auc"] - r[f"{p}_auc"], 4)
                for p in POLICIES
                if r.get(f"{p}_auc") is not None
            }
        )
    return out


def _per_day(bt: Backtest, preds: dict[str, np.ndarray]) -> list[dict]:
    """Per day: its rows, warm rows, each comparator's AUC on the day (`<name>`) and on every row scored
    so far (`cum_<name>`)."""
    y, warm = bt.labels(), bt.warm[bt.first : bt.last]
    rows = []
    for day in bt.days:
        at = slice(day.start - bt.first, day.stop - bt.first)
        upto = slice(0, day.stop - bt.first)
        rows.append(
            {
                "date": day.date,
                "rows": day.rows,
                "warm_rows": int(warm[at].sum()),
                **{n: summary(y[at], p[at], warm[at])["auc"] for n, p in preds.items()},
                **{f"cum_{n}": summary(y[upto], p[upto], warm[upto])["auc"] for n, p in preds.items()},
            }
        )
    return rows


def _share(s: dict) -> str:
    return "-" if s["value"] is None else f"{s['value']} [{s['lo']}, {s['hi']}] of {s['n']}"


def table(r: dict) -> str:
    """The result as a small markdown table (the CLI's output without --json)."""
    lines = [
        f"backtest {r['from']}..{r['to']} (model family {r.get('model_family')}): {r['days']} days, {r['rows']} "
        f"rows ({r['warm_rows']} warm, {r['cold_rows']} cold at scoring, {r.get('new_item_rows')} of new items)",
        "",
        "| comparator | AUC | AUC warm | AUC cold | AUC new items | AUC within slot-day | training CPU s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in (*COMPARATORS, *POLICIES):
        if f"{name}_auc" in r:
            lines.append(
                f"| {name} | {r[f'{name}_auc']} | {r[f'{name}_auc_warm']} | {r[f'{name}_auc_cold']} | "
                f"{r.get(f'{name}_auc_new_item')} | {r.get(f'{name}_auc_within_slot_day')} | "
                f"{r.get(f'{name}_cpu_s', '-')} |"
            )
    if "gate_releases" in r:
        t = r["gate_trust"]
        lines += [
            "",
            f"served: {r['gate_releases']} releases, {r['gate_rejections']} rejections, {r['gate_held']} held, "
            f"{r.get('judge_waits', 0)} waits (judged on the next days); "
            f"canaries {r['canary_promotions']} promoted, {r['canary_withdrawals']} withdrawn; "
            f"{r['reverts']} reverts; released then worse next day {t['released_worse']}/{t['released_judged']}, "
            f"rejected then better {t['rejected_better']}/{t['rejected_judged']}; gate precision "
            f"{_share(r['gate_precision'])}",
        ]
        if r.get("fault"):
            lines.append(f"fault (flipped labels on {r['fault']['day']}): caught by {r['fault']['caught_by']}")
    return "\n".join(lines)
