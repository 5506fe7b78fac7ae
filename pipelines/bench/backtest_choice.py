"""`python -m pipelines backtest --choose ranks|orthogonality`: a LoRA option chosen on validation days,
then measured on the test days (issue 14, item 4).

Every candidate is the `adapter` comparator (a daily LoRA adapter per slot on the static base) with
some `lora` settings changed; all candidates of a choice replay the same days in one pass, on one static
base. The rule, on the validation days only:
* `best` = the highest validation AUC; every candidate within `MARGIN` of it is as good (the spread of
  one configuration between seeds is about that, docs/history.md);
* of those, the one with the fewest adapter bytes; at equal bytes, the earlier in the list (the
  default comes first). So a smaller candidate within the margin is taken even a little below the
  default, and among equal-sized ones (the penalty's lambdas) an option stays off unless it beats the
  default by more than the margin.
The chosen candidate and the default are then replayed on the test days; the test days choose nothing.

`schedule`: how hard and on what an adapter trains: the config's lr on every layer (`all_layers`), lr / 5
and lr / 25; the untrained adapter as a candidate epoch (`lora.keep_base_if_no_gain`); LoRA on the top
layer only (`lora.layers`, for the families with one numbered layer list), at the config's lr, at lr / 5,
and at lr / 5 on a window 4 times as long (the backward pass stops at the top layer, so that window costs
less than it would on every layer). It was added for the text family, whose adapters of the earlier recipe
lowered its base (docs/benchmarks.md, Model families side by side).
`delta` (a config whose `lora.kind` is delta): the shipped delta recipe and each of its settings changed
once (`DELTA_VARIANTS`: per slot instead of every slot's rows, the window, Adagrad's lr, the anchor, epochs,
early stopping on the newest rows). A delta's bytes follow its window's ids, so this choice keeps the
earliest candidate within the margin: the shipped recipe unless a variant beats it by more.
`ranks`: r in {2, 4, 8, 16} for every module, and per-layer patterns (PEFT `rank_pattern`: q against v,
lower blocks against upper blocks). `orthogonality`: lambda in {0, 0.1, 1, 10} for the penalty against
the other slots' newest adapters (`lora.orthogonality_lambda`). Each candidate also reports its
adapters' largest |cos| with those siblings (min / median / max over the adapters trained).
"""

from __future__ import annotations

import dataclasses
import logging
import time

from pipelines.bench import backtest_models as bm
from pipelines.bench.backtest import replay
from pipelines.bench.backtest_protocol import auc_within, build, summary
from pipelines.config import PipelineConfig
from pipelines.data import movielens
from pipelines.errors import ConfigError
from pipelines.model import adapters, family

log = logging.getLogger(__name__)

VALIDATION = ("1998-01-20", "1998-03-06")  # the 46 days before the test period (as adapter_ids was chosen)
MARGIN = 0.003
DEFAULT = {"ranks": "r8", "orthogonality": "lambda_0", "schedule": "all_layers", "delta": "shipped"}
# The variations of the shipped delta recipe `--choose delta` replays (one setting changed each).
DELTA_VARIANTS = {
    "shipped": {},
    "per_slot": {"train_rows": "slot"},
    "window_4": {"window_days": 4},
    "window_14": {"window_days": 14},
    "window_28": {"window_days": 28},
    "lr_0.1": {"lr": 0.1},
    "lr_1": {"lr": 1.0},
    "l2_3": {"delta_l2": 3.0},
    "l2_30": {"delta_l2": 30.0},
    "epochs_5": {"epochs": 5},
    "early_stopping": {"val_fraction": 0.1},
}


def candidates(cfg: PipelineConfig, choice: str) -> dict[str, dict]:
    """{name: `lora` overrides} of a choice, the default first. Layer patterns follow the config's
    blocks (lower half / upper half), so they name modules that exist."""
    if choice == "orthogonality":
        return {
            "lambda_0": {},
            "lambda_0.1": {"orthogonality_lambda": 0.1},
            "lambda_1": {"orthogonality_lambda": 1.0},
            "lambda_10": {"orthogonality_lambda": 10.0},
        }
    if choice == "schedule":
        return _schedule(cfg)
    if choice == "delta":
        if cfg.lora.kind != "delta":
            raise ConfigError("backtest --choose delta varies the config's delta recipe: set lora.kind: delta")
        return dict(DELTA_VARIANTS)
    if choice != "ranks":
        raise ConfigError(f"backtest --choose: unknown choice {choice!r}; choose from {sorted(DEFAULT)}")
    out = {"r8": {"r": 8}, "r2": {"r": 2}, "r4": {"r": 4}, "r16": {"r": 16}}
    targets = [t for t in cfg.lora.target_modules if t != "embeddings"]
    for t in targets if len(targets) > 1 else ():
        out[f"r8_{t}_r2"] = {"r": 8, "rank_pattern": {t: 2}}
    half = cfg.model.n_blocks // 2
    if half:
        lower = {f"blocks.{i}.{t}": 2 for i in range(half) for t in targets}
        upper = {f"blocks.{i}.{t}": 2 for i in range(half, cfg.model.n_blocks) for t in targets}
        out.update(
            {
                "r8_lower_blocks_r2": {"r": 8, "rank_pattern": lower},
                "r8_upper_blocks_r2": {"r": 8, "rank_pattern": upper},
            }
        )
    return out


def _schedule(cfg: PipelineConfig) -> dict[str, dict]:
    lora = bm.lora_only_config(cfg.lora)  # a LoRA recipe's schedule, whatever kind the config ships
    lr, window = lora.lr, lora.window_days
    out = {
        "all_layers": {},
        "lr_div5": {"lr": lr / 5},
        "lr_div25": {"lr": lr / 25},
        "keep_base": {"keep_base_if_no_gain": True},
    }
    top = top_layer(cfg)
    if top is not None:
        out.update(
            {
                "top_layer": {"layers": (top,)},
                "top_layer_lr_div5": {"layers": (top,), "lr": lr / 5},
                "top_layer_lr_div5_window_x4": {"layers": (top,), "lr": lr / 5, "window_days": 4 * window},
            }
        )
    return out


def top_layer(cfg: PipelineConfig) -> int | None:
    """`lora.layers`' name of the top layer (-1), or None where the family's model has no one numbered layer
    list holding `lora.target_modules` (dcn). Asked of a built model (no weights loaded), so a family of the
    user's (`model.family: pkg.mod:Factory`) gets the top-layer candidates when its layers are one list."""

    model = family.resolve(cfg.model.family).build(cfg.model)
    try:
        adapters.layer_indices(model, dataclasses.replace(cfg.lora, layers=(-1,)))
    except ConfigError:
        return None
    return -1


def choose(rows: dict[str, dict], margin: float = MARGIN, by_bytes: bool = True) -> str:
    """The rule above, on {name: {"auc", "adapter_bytes"}} in preference order. Pure. `by_bytes` False: the
    earliest candidate within the margin (a delta's bytes follow its window's ids, not its recipe's cost)."""
    scored = {n: r for n, r in rows.items() if r.get("auc") is not None}
    if not scored:
        raise ConfigError("backtest --choose: no candidate has a validation AUC")
    best = max(r["auc"] for r in scored.values())
    order = list(rows)
    near = [n for n, r in scored.items() if r["auc"] >= best - margin]
    return min(
        near, key=lambda n: ((scored[n].get("adapter_bytes") or float("inf")) if by_bytes else 0, order.index(n))
    )


def _measure(
    cfg: PipelineConfig,
    frame,
    overrides: dict[str, dict],
    day_from: str | None,
    day_to: str | None,
    max_days: int | None,
    base_cache: str | None = None,
    choice: str = "",
) -> dict:
    """One replay of `static` and every candidate over the days: AUC (warm / cold), CPU, bytes, |cos|."""
    bt = build(frame, day_from, day_to, max_days)
    static = bm.Static(cfg, base_cache)
    models: dict[str, bm.Comparator] = {"static": static}
    for name, over in overrides.items():
        # from the config's lora with both options off, so a candidate is exactly what its name says (a
        # delta recipe: the config's, one setting changed)
        plain = (
            cfg.lora
            if cfg.lora.kind == "delta" and choice == "delta"
            else dataclasses.replace(
                bm.lora_only_config(cfg.lora),
                rank_pattern={},
                orthogonality_lambda=0.0,
                layers=(),
                keep_base_if_no_gain=False,
            )
        )
        lora = dataclasses.replace(plain, **over)
        models[name] = bm.SlotAdapters(name, cfg, lora, static, per_slot=lora.train_rows == "slot")
    t0 = time.perf_counter()
    preds = replay(models, bt)
    y, warm, groups = bt.labels(), bt.warm[bt.first : bt.last], bt.slot_days()
    out = {
        "from": bt.days[0].date,
        "to": bt.days[-1].date,
        "days": len(bt.days),
        "rows": int(len(y)),
        "candidates": {},
        "wall_s": 0.0,
    }
    for name, model in models.items():
        s = summary(y, preds[name], warm)
        row = {
            "auc": s["auc"],
            "auc_warm": s["auc_warm"],
            "auc_cold": s["auc_cold"],
            "auc_within_slot_day": auc_within(y, preds[name], groups),
        }
        if name != "static":
            info = model.info()
            row.update(
                cpu_s=round(model.cpu_s, 1),
                adapter_bytes=info["adapter_bytes"],
                max_abs_cos=info["max_abs_cos"],
                update_norm=info["update_norm"],
                lora=overrides[name],
            )
        out["candidates"][name] = row
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def run(
    cfg: PipelineConfig,
    frame=None,
    *,
    choice: str,
    validation: tuple[str, str] = VALIDATION,
    test: tuple[str | None, str | None] = (None, None),
    max_days: int | None = None,
    only: list[str] | None = None,
    base_cache: str | None = None,
    val_days: int | None = None,
) -> dict:
    """Choose on `validation`, then replay the chosen candidate and the default on `test` (default: the
    backtest's test days). `only`: a subset of the candidates (the default is always kept); `max_days`:
    at most this many days of each range (a smoke run); `val_days`: at most this many validation days (the
    first ones; a choice for a slow family); `base_cache`: as `backtest.run`'s."""
    if frame is None:
        frame = movielens.load()
    every = candidates(cfg, choice)
    unknown = sorted(set(only or ()) - set(every))
    if unknown:
        raise ConfigError(f"backtest --choose {choice}: unknown candidates {unknown}; choose from {list(every)}")
    default = DEFAULT[choice]
    picked = {n: o for n, o in every.items() if not only or n in only or n == default}
    limits = [d for d in (max_days, val_days) if d is not None]
    val = _measure(cfg, frame, picked, *validation, min(limits) if limits else None, base_cache, choice)
    by_bytes = choice != "delta"
    chosen = choose({n: r for n, r in val["candidates"].items() if n != "static"}, by_bytes=by_bytes)
    log.info("backtest --choose %s: %s chosen on %s..%s", choice, chosen, val["from"], val["to"])
    final = {n: picked[n] for n in dict.fromkeys((default, chosen))}
    rule = (
        f"fewest adapter bytes within {MARGIN} of the best validation AUC, then the earlier candidate (the "
        "default first)"
        if by_bytes
        else f"the earliest candidate (the default first) within {MARGIN} of the best validation AUC"
    )
    return {
        "choice": choice,
        "rule": rule,
        "default": default,
        "chosen": chosen,
        "validation": val,
        "test": _measure(cfg, frame, final, *test, max_days, base_cache, choice),
    }


def table(r: dict) -> str:
    """Both replays as markdown tables (the CLI's output without --json)."""
    lines = [f"backtest --choose {r['choice']}: chosen {r['chosen']} (default {r['default']}; {r['rule']})"]
    for part in ("validation", "test"):
        p = r[part]
        lines += [
            "",
            f"{part} {p['from']}..{p['to']} ({p['days']} days, {p['rows']} rows)",
            "",
            "| candidate | lora | AUC | warm | cold | within slot-day | CPU s | bytes "
            "| max abs cos (min / median / max) | median norm of dW |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, c in p["candidates"].items():
            cos, norm = c.get("max_abs_cos"), c.get("update_norm")
            spread = " / ".join(f"{cos[k]:.2f}" for k in ("min", "median", "max")) if cos else "-"
            median_norm = f"{norm['median']:.3f}" if norm else "-"
            lines.append(
                f"| {name} | {c.get('lora', '-')} | {c['auc']} | {c['auc_warm']} | {c['auc_cold']} | "
                f"{c['auc_within_slot_day']} | {c.get('cpu_s', '-')} | {c.get('adapter_bytes', '-')} | {spread} | "
                f"{median_norm} |"
            )
    return "\n".join(lines)
