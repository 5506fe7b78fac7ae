"""`python -m pipelines backtest --choose base`: the base recipe chosen on several validation cuts, then
measured on the test days (issue 31, item 1).

A base is fitted once, at a cut, and scores every later day (`static`), so one cut's days judge one fit:
at the validation cut alone the earlier recipe led the one-hot LR by 0.005 AUC and then lost to it on the
test days by as much. So each candidate (`BASE_VARIANTS`: the shipped recipe, each of its settings undone
once, and the recipe before issue 31's last change) is fitted at each of `CUTS` (rolling origins, all
before the test period: the last is the validation days) and scored on the days up to the next; `lr_static`
is scored beside it at each cut as the reference. The rule: the highest mean AUC over the cuts is `best`;
the earliest candidate (the shipped one first) within `MARGIN` of it is chosen. The chosen recipe, the
shipped one and `lr_static` are then scored on the test days, which choose nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from pipelines.bench import backtest
from pipelines.bench.backtest_choice import MARGIN
from pipelines.config import PipelineConfig
from pipelines.data import movielens
from pipelines.errors import ConfigError

log = logging.getLogger(__name__)

# (first scored day, last): three rolling origins before the test period; the last are the validation days.
CUTS = (("1997-11-15", "1997-12-14"), ("1997-12-15", "1998-01-19"), ("1998-01-20", "1998-03-06"))
BASE_VARIANTS = {
    "shipped": {},
    "fixed_l2": {"base_training": {"wide_l2_grid": ()}},  # wide_l2 (3.33) at every fit
    "every_field": {"base_training": {"wide_fields": ()}},  # hour and weekday in the LR too
    "wide_ids_2e14": {"model": {"wide_id_buckets": 0}},  # the LR's id rows = the embeddings'
    "small_64": {"model": {"small_buckets": 64}},
    "lr_alone": {"base_training": {"epochs": 0}},  # no deep part
    "before": {
        "model": {"small_buckets": 64, "wide_id_buckets": 0},  # the recipe this choice replaced
        "base_training": {"wide_l2_grid": (), "wide_fields": ()},
    },
}


def variant(cfg: PipelineConfig, overrides: dict) -> PipelineConfig:
    """`cfg` with a candidate's `model` and `base_training` settings changed."""
    unknown = sorted(set(overrides) - {"model", "base_training"})
    if unknown:
        raise ConfigError(f"backtest --choose base: a candidate changes model and base_training only, not {unknown}")
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, **overrides.get("model", {})),
        base_training=dataclasses.replace(cfg.base_training, **overrides.get("base_training", {})),
    )


def choose(mean_auc: dict[str, float | None], margin: float = MARGIN) -> str:
    """The earliest candidate (in `mean_auc`'s order) within `margin` of the best mean AUC. Pure."""
    scored = {n: a for n, a in mean_auc.items() if a is not None}
    if not scored:
        raise ConfigError("backtest --choose base: no candidate has a validation AUC")
    best = max(scored.values())
    return next(n for n in mean_auc if n in scored and scored[n] >= best - margin)


def _static(
    cfg: PipelineConfig, frame, day_from: str | None, day_to: str | None, max_days: int | None, with_lr: bool
) -> dict:
    names = ("static", "lr_static") if with_lr else ("static",)
    r = backtest.run(cfg, frame, day_from=day_from, day_to=day_to, max_days=max_days, names=names, parallel=False)
    out = {k: r[k] for k in ("from", "to", "days", "rows")}
    for key, name in zip(("candidate", "lr_static"), names):
        out[key] = {k: r[f"{name}_{k}"] for k in ("auc", "auc_warm", "auc_cold")}
    return out


def run(
    cfg: PipelineConfig,
    frame=None,
    *,
    cuts=CUTS,
    test: tuple[str | None, str | None] = (None, None),
    max_days: int | None = None,
    only: list[str] | None = None,
) -> dict:
    """Every candidate at every cut, the choice, then the chosen and shipped recipes on `test`. `only`: a
    subset of the candidates (the shipped one is always kept); `max_days`: at most this many days a cut."""
    if frame is None:
        frame = movielens.load()
    unknown = sorted(set(only or ()) - set(BASE_VARIANTS))
    if unknown:
        raise ConfigError(f"backtest --choose base: unknown candidates {unknown}; choose from {list(BASE_VARIANTS)}")
    picked = {n: o for n, o in BASE_VARIANTS.items() if not only or n in only or n == "shipped"}
    t0 = time.perf_counter()
    per_cut: dict[str, list[dict]] = {n: [] for n in (*picked, "lr_static")}
    for first, last in cuts:
        for i, (name, over) in enumerate(picked.items()):
            r = _static(variant(cfg, over), frame, first, last, max_days, with_lr=i == 0)
            per_cut[name].append({"from": r["from"], "to": r["to"], "rows": r["rows"], **r["candidate"]})
            if i == 0:
                per_cut["lr_static"].append({"from": r["from"], "to": r["to"], "rows": r["rows"], **r["lr_static"]})
            log.info("backtest --choose base: %s at %s: static AUC %s", name, first, r["candidate"]["auc"])
    mean = {n: _mean([c["auc"] for c in rows]) for n, rows in per_cut.items()}
    chosen = choose({n: mean[n] for n in picked})
    final = {n: picked[n] for n in dict.fromkeys(("shipped", chosen))}
    tested = {n: _static(variant(cfg, o), frame, *test, None, with_lr=n == "shipped") for n, o in final.items()}
    test_rows = {n: t["candidate"] for n, t in tested.items()}
    test_rows["lr_static"] = tested["shipped"]["lr_static"]
    return {
        "choice": "base",
        "rule": f"the earliest candidate (shipped first) within {MARGIN} of the best mean "
        f"static AUC over {len(cuts)} validation cuts",
        "chosen": chosen,
        "candidates": picked,
        "validation": {"cuts": [list(c) for c in cuts], "per_cut": per_cut, "mean_auc": mean},
        "test": {k: tested["shipped"][k] for k in ("from", "to", "days", "rows")} | {"candidates": test_rows},
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def _mean(values: list) -> float | None:
    return None if not values or any(v is None for v in values) else round(sum(values) / len(values), 4)


def table(r: dict) -> str:
    """The validation cuts and the test days as markdown tables (the CLI's output without --json)."""
    cuts = r["validation"]["per_cut"]["shipped"]
    lines = [
        f"backtest --choose base: chosen {r['chosen']} ({r['rule']})",
        "",
        "| candidate | " + " | ".join(f"{c['from']}..{c['to']} ({c['rows']} rows)" for c in cuts) + " | mean |",
        "|---|" + "---|" * (len(cuts) + 1),
    ]
    for name, rows in r["validation"]["per_cut"].items():
        lines.append(
            f"| {name} {r['candidates'].get(name, '')} | "
            + " | ".join(f"{c['auc']} ({c['auc_warm']} / {c['auc_cold']})" for c in rows)
            + f" | {r['validation']['mean_auc'][name]} |"
        )
    t = r["test"]
    lines += [
        "",
        f"test {t['from']}..{t['to']} ({t['days']} days, {t['rows']} rows)",
        "",
        "| candidate | AUC | warm | cold |",
        "|---|---|---|---|",
    ]
    lines += [f"| {n} | {c['auc']} | {c['auc_warm']} | {c['auc_cold']} |" for n, c in t["candidates"].items()]
    return "\n".join(lines)
