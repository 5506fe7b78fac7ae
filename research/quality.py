"""`python -m research.quality`: model quality on MovieLens-100K, temporal split, side by side.

Protocol (nothing below looks at the test rows until the final scoring):

* all 100,000 ratings sorted by event time; the earliest 80 % are the *train* part, the rest the *test*
  part. Most test rows come from users who have no event in the train part ("cold users");
* hyperparameters are chosen on a *validation* split carved from the train part the same way (its
  latest 10 % by time, "fit" = the rest), then each model is refit on the whole train part;
* metrics on the test part: AUC overall, AUC on cold-user rows, AUC on warm-user rows, logloss.

Rows of the comparison:

1. ``lr``: scikit-learn ``OneHotEncoder(handle_unknown="ignore")`` + ``LogisticRegression`` on user,
   item, gender, age bucket, occupation, category (genre) and slot; C chosen on validation;
2. ``base``: the base ``CTRModel`` trained on every parameter with ``pipelines.training.loop.train``;
   model config (embedding dim, dropout, table sizes, the first-order ``wide`` term), lr, weight
   decay, batch size, number of epochs and whether the hour/weekday fields are used are chosen on
   validation (see ``BASE_GRID``);
3. ``lora``: the trained base + one LoRA adapter per slot (``adapters.attach`` on a copy of the base made
   with ``store.save_base``/``load_base``), trained on that slot's train rows and scoring that slot's
   test rows; adapter epochs chosen on validation;
4. ``distilled`` (optional): a callable supplied by the cold-start module, see ``QualityContext``;
   the CLI uses ``research.quality_distill.make_distilled()`` (its protocol is in that module).

"Our best model" is the one of rows 2-4 with the best *validation* AUC (row 4 only if it reports one).

Where the pieces live: the metrics and the distilled hook's contract in ``research.quality_protocol``;
the split and the LR row in the backtest that still uses them (``pipelines.bench.backtest_protocol``,
``pipelines.bench.backtest_lr``); rows 2 and 3 in ``research.quality_models``; this module runs the rows
in order and reports them.

Output: one flat JSON object; per row ``<row>_auc``, ``_auc_cold``, ``_auc_warm``, ``_logloss``,
``_val_auc``, ``<row>_minus_lr_auc[_cold]``; ``best_model`` and the goal booleans
(``goal_best_beats_lr_overall`` / ``_cold``, ``goal_met``: the best model beats LR by ``GOAL_MARGIN``
AUC overall and on cold users); each row's selection trail (``lr_val_auc_by_C``, ``base_search``,
``lora_val_by_slot``), wall times (``*_secs``) and ``table`` (the rows side by side).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from pipelines.bench.backtest_lr import LR_C_GRID, fit_lr, predict_lr, tune_lr
from pipelines.bench.backtest_protocol import TRAIN_FRACTION, VAL_FRACTION, temporal_split
from pipelines.config import LoraTrainConfig
from pipelines.data import movielens
from pipelines.metrics import auc
from pipelines.model import store
from research.quality_distill import make_distilled
from research.quality_models import (
    BASE_GRID,
    LORA_MAX_EPOCHS,
    BaseCandidate,
    predict_base,
    slot_adapters,
    train_base,
    tune_base,
)
from research.quality_protocol import GOAL_MARGIN, SEED, DistilledFn, QualityContext, cold_mask, scores

SCORE_KEYS = ("auc", "auc_cold", "auc_warm", "logloss")


@dataclass
class _Table:
    """What one run builds up: the protocol's four parts, the flat output (keys in the order they are
    reported), and each row's test scores and validation AUC (the latter picks "our best model")."""

    train: pd.DataFrame
    test: pd.DataFrame
    fit: pd.DataFrame
    val: pd.DataFrame
    out: dict = field(default_factory=dict)
    rows: dict[str, dict] = field(default_factory=dict)
    val_auc: dict[str, float | None] = field(default_factory=dict)

    @classmethod
    def split(cls, frame: pd.DataFrame) -> "_Table":
        train, test = temporal_split(frame, TRAIN_FRACTION)
        fit, val = temporal_split(train, 1.0 - VAL_FRACTION)
        t = cls(train, test, fit, val)
        val_cold = cold_mask(fit, val)
        t.out.update(
            {
                "benchmark": "MovieLens-100K temporal split 80/20: LR one-hot vs CTRModel vs CTRModel+slot LoRA",
                "rows": len(frame),
                "train_rows": len(train),
                "test_rows": len(test),
                "val_rows": len(val),
                "test_cold_share": round(float(t.cold.mean()), 4),
                "val_cold_share": round(float(val_cold.mean()), 4),
                "test_label_rate": round(float(t.y_test.mean()), 4),
            }
        )
        return t

    @property
    def cold(self) -> np.ndarray:
        return cold_mask(self.train, self.test)

    @property
    def y_test(self) -> np.ndarray:
        return self.test["label"].to_numpy()

    @property
    def y_val(self) -> np.ndarray:
        return self.val["label"].to_numpy()

    def add(self, name: str, p_test: np.ndarray, val_auc: float | None) -> None:
        self.rows[name] = scores(self.y_test, p_test, self.cold)
        self.val_auc[name] = val_auc


# ------------------------------------------------------------------------------------- rows
def _lr_row(t: _Table, lr_grid) -> None:
    """(i) logistic regression: C chosen on validation, refit on the whole train part."""
    start = time.perf_counter()
    C, c_curve = tune_lr(t.fit, t.val, lr_grid)
    t.add("lr", predict_lr(fit_lr(t.train, C), t.test), c_curve[str(C)])
    t.out.update(lr_C=C, lr_val_auc_by_C=c_curve, lr_secs=round(time.perf_counter() - start, 1))


def _base_row(t: _Table, base_grid: tuple[BaseCandidate, ...], spread_seeds: int):
    """(ii) base CTRModel, full training, chosen on validation and refit on the train part; returns
    (chosen candidate, refit model, the fit-only model at the chosen point)."""
    start = time.perf_counter()
    search: list[dict] = []
    cand, epoch, base_val_auc, fit_model = tune_base(t.fit, t.val, base_grid, log=search)
    base_model, _ = train_base(cand, t.train, stop_epoch=epoch)
    t.add("base", predict_base(base_model, cand, t.test), round(base_val_auc, 4))
    t.out.update(
        base_config=cand.describe(),
        base_epochs=epoch,
        base_search=search,
        base_secs=round(time.perf_counter() - start, 1),
    )
    _seed_spread(t, cand, epoch, spread_seeds)
    return cand, base_model, fit_model


def _seed_spread(t: _Table, cand: BaseCandidate, epoch: int, spread_seeds: int) -> None:
    """The chosen base refit with `spread_seeds` other seeds: the noise a difference to LR is read
    against (reported only, never used to choose)."""
    spread = [
        scores(
            t.y_test,
            predict_base(train_base(cand, t.train, stop_epoch=epoch, seed=SEED + 1 + i)[0], cand, t.test),
            t.cold,
        )
        for i in range(spread_seeds)
    ]
    if not spread:
        return
    for k in ("auc", "auc_cold"):
        vals = [t.rows["base"][k]] + [r[k] for r in spread]
        t.out[f"base_seed_spread_{k}"] = {
            "seeds": len(vals),
            "min": min(vals),
            "max": max(vals),
            "mean": round(float(np.mean(vals)), 4),
        }


def _lora_row(
    t: _Table, cand: BaseCandidate, base_dir: Path, fit_base_dir: Path, lcfg: LoraTrainConfig, max_epochs: int
) -> None:
    """(iii) base + one LoRA adapter per slot; adapter epochs chosen on validation (on the fit-only
    base), then the same epochs on the refit base."""
    start = time.perf_counter()
    p_val, val_info = slot_adapters(fit_base_dir, cand, t.fit, t.val, lcfg, max_epochs=max_epochs)
    epochs_by_slot = {s: i["epoch"] for s, i in val_info.items()}
    p_test, _ = slot_adapters(
        base_dir, cand, t.train, t.test, lcfg, epochs_by_slot=epochs_by_slot, max_epochs=max_epochs
    )
    t.add("lora", p_test, round(auc(t.y_val, p_val), 4))
    t.out.update(
        lora_epochs_by_slot=epochs_by_slot,
        lora_val_by_slot=val_info,
        lora_r=lcfg.r,
        lora_targets=list(lcfg.target_modules),
        lora_secs=round(time.perf_counter() - start, 1),
    )


def _distilled_row(t: _Table, distilled: DistilledFn, ctx: QualityContext) -> None:
    """(iv) distilled adapters (cold-start module), optional; see QualityContext."""
    start = time.perf_counter()
    try:
        pv = distilled(ctx, stage="val")
        pt = np.asarray(distilled(ctx, stage="test"), dtype=np.float64)
    except RuntimeError as exc:
        # The optional row cannot be built for this base (reported, the other rows stand).
        t.out["distilled_error"] = str(exc)
        print(f"research.quality: distilled row skipped: {exc}", file=sys.stderr)
    else:
        if pt.shape != (len(t.test),):
            raise ValueError(f"distilled(stage='test') must return {len(t.test)} pCTRs, got shape {pt.shape}")
        t.add("distilled", pt, None if pv is None else round(auc(t.y_val, np.asarray(pv, dtype=np.float64)), 4))
    t.out["distilled_secs"] = round(time.perf_counter() - start, 1)


# ----------------------------------------------------------------------------------- verdict
def _verdict(t: _Table) -> dict:
    """Every row's scores as flat keys, the best of our rows by validation AUC, its margin over LR and
    the goals, and the side-by-side table."""
    rows, val_auc = t.rows, t.val_auc
    out: dict = {}
    for name, r in rows.items():
        out.update({f"{name}_{k}": v for k, v in r.items()})
        out[f"{name}_val_auc"] = val_auc[name]
    if "distilled" not in rows:
        out.update({f"distilled_{k}": None for k in SCORE_KEYS + ("val_auc",)})
    ours = {k: v for k, v in val_auc.items() if k != "lr" and v is not None}
    best = max(ours, key=ours.get)
    out["best_model"] = best
    out["best_model_chosen_on"] = "validation AUC"
    lr = rows["lr"]
    for name in [k for k in rows if k != "lr"]:
        out[f"{name}_minus_lr_auc"] = round(rows[name]["auc"] - lr["auc"], 4)
        out[f"{name}_minus_lr_auc_cold"] = round(rows[name]["auc_cold"] - lr["auc_cold"], 4)
    out["goal_best_beats_lr_overall"] = out[f"{best}_minus_lr_auc"] >= GOAL_MARGIN
    out["goal_best_beats_lr_cold"] = out[f"{best}_minus_lr_auc_cold"] >= GOAL_MARGIN
    out["goal_met"] = out["goal_best_beats_lr_overall"] and out["goal_best_beats_lr_cold"]
    out["table"] = {name: {**r, "val_auc": val_auc[name]} for name, r in rows.items()}
    return out


# ------------------------------------------------------------------------------------ driver
def run(
    distilled: DistilledFn | None = None,
    frame: pd.DataFrame | None = None,
    base_grid: tuple[BaseCandidate, ...] = BASE_GRID,
    lr_grid=LR_C_GRID,
    lora_cfg: LoraTrainConfig | None = None,
    lora_max_epochs: int = LORA_MAX_EPOCHS,
    spread_seeds: int = 3,
) -> dict:
    """The full comparison on MovieLens-100K (or on `frame`, for tests); returns one JSON-safe dict.

    `distilled`: optional fourth row, see QualityContext. `spread_seeds`: the chosen base
    configuration is also refit with this many other seeds, and their test AUCs are reported
    (``base_seed_spread_*``) so that a difference to LR can be read against seed-to-seed noise; they
    play no part in any choice.
    """
    t_start = time.perf_counter()
    if frame is None:
        frame = movielens.load()
    lcfg = lora_cfg or LoraTrainConfig()
    t = _Table.split(frame)
    _lr_row(t, lr_grid)
    cand, base_model, fit_model = _base_row(t, base_grid, spread_seeds)
    with tempfile.TemporaryDirectory() as tmp:
        base_dir, fit_base_dir = Path(tmp) / "base", Path(tmp) / "fit_base"
        store.save_base(base_model, base_dir)
        store.save_base(fit_model, fit_base_dir)
        _lora_row(t, cand, base_dir, fit_base_dir, lcfg, lora_max_epochs)
        if distilled is not None:
            _distilled_row(
                t,
                distilled,
                QualityContext(
                    base_dir=base_dir,
                    fit_base_dir=fit_base_dir,
                    model_cfg=cand.model,
                    drop_fields=cand.drop_fields,
                    train=t.train,
                    test=t.test,
                    fit=t.fit,
                    val=t.val,
                    lora_cfg=lcfg,
                ),
            )
    out = {**t.out, **_verdict(t)}
    out["wall_s"] = round(time.perf_counter() - t_start, 1)
    return out


def markdown_table(result: dict) -> str:
    lines = ["| model | AUC | AUC cold users | AUC warm users | logloss | val AUC |", "|---|---|---|---|---|---|"]
    for name, r in result["table"].items():
        lines.append(f"| {name} | {r['auc']} | {r['auc_cold']} | {r['auc_warm']} | {r['logloss']} | {r['val_auc']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m research.quality", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--table", action="store_true", help="also print a markdown table (to stderr)")
    a = p.parse_args(argv)
    r = run(distilled=make_distilled())
    print(json.dumps(r), flush=True)
    if a.table:
        print(markdown_table(r), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
