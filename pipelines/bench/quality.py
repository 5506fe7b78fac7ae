"""`python -m pipelines.bench.quality`: model quality on MovieLens-100K, temporal split, side by side.

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
   the CLI uses ``pipelines.bench.quality_distill.make_distilled()`` (its protocol is in that module).

"Our best model" is the one of rows 2-4 with the best *validation* AUC (row 4 only if it reports one).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

from pipelines.config import LoraTrainConfig, ModelConfig
from pipelines.data.schema import FEATURE_FIELDS
from pipelines.metrics import auc, logloss

TRAIN_FRACTION = 0.8
VAL_FRACTION = 0.1           # of the train part, its latest rows
LR_FEATURES = ("user_id", "item_id", "gender", "age_bucket", "occupation", "category", "slot")
LR_C_GRID = (0.03, 0.1, 0.3, 1.0, 3.0)
GOAL_MARGIN = 0.01
SEED = 7


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
        return {"embed_dim": m.embed_dim, "n_blocks": m.n_blocks, "dropout": m.dropout, "id_buckets": m.id_buckets,
                "small_buckets": m.small_buckets, "wide": m.wide, "lr": self.lr, "weight_decay": self.weight_decay,
                "batch_size": self.batch_size, "max_epochs": self.max_epochs, "drop_fields": list(self.drop_fields)}


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
    BaseCandidate(),                                                             # the pipeline's defaults
    BaseCandidate(model=ModelConfig(embed_dim=16, dropout=0.3), drop_fields=_HW),
    BaseCandidate(model=ModelConfig(embed_dim=16, dropout=0.5), drop_fields=_HW),
    BaseCandidate(model=ModelConfig(embed_dim=16, dropout=0.3), drop_fields=_HW, lr=1e-3),
    BaseCandidate(model=ModelConfig(embed_dim=8, dropout=0.3), drop_fields=_HW),
    BaseCandidate(model=ModelConfig(embed_dim=8, dropout=0.3, wide=True), drop_fields=_HW),
    BaseCandidate(model=ModelConfig(embed_dim=8, dropout=0.3, wide=True), drop_fields=_HW, batch_size=2048, lr=1e-2,
                  max_epochs=6),
)
LORA_MAX_EPOCHS = 3


# ------------------------------------------------------------------------------------ splits
def temporal_split(frame: pd.DataFrame, fraction: float) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(earliest `fraction` of the rows by event time, the rest); stable for equal timestamps."""
    f = frame.sort_values("event_ts", kind="stable").reset_index(drop=True)
    cut = int(round(fraction * len(f)))
    return f.iloc[:cut].reset_index(drop=True), f.iloc[cut:].reset_index(drop=True)


def cold_mask(train: pd.DataFrame, frame: pd.DataFrame) -> np.ndarray:
    """True for rows of `frame` whose user has no event in `train`."""
    return ~frame["user_id"].isin(set(train["user_id"])).to_numpy()


def scores(y: np.ndarray, p: np.ndarray, cold: np.ndarray) -> dict:
    def clean(v: float):
        return None if v is None or (isinstance(v, float) and math.isnan(v)) else round(float(v), 4)

    return {"auc": clean(auc(y, p)), "auc_cold": clean(auc(y[cold], p[cold])),
            "auc_warm": clean(auc(y[~cold], p[~cold])), "logloss": clean(logloss(y, p))}


# ---------------------------------------------------------------------------------------- LR
def _lr_pipeline(C: float):
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import OneHotEncoder

    return make_pipeline(OneHotEncoder(handle_unknown="ignore"), LogisticRegression(C=C, max_iter=3000))


def _lr_x(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[list(LR_FEATURES)].astype(str)


def fit_lr(train: pd.DataFrame, C: float):
    return _lr_pipeline(C).fit(_lr_x(train), train["label"].to_numpy())


def predict_lr(model, frame: pd.DataFrame) -> np.ndarray:
    return model.predict_proba(_lr_x(frame))[:, 1]


def tune_lr(fit: pd.DataFrame, val: pd.DataFrame, grid=LR_C_GRID) -> tuple[float, dict]:
    yv = val["label"].to_numpy()
    val_auc = {C: auc(yv, predict_lr(fit_lr(fit, C), val)) for C in grid}
    return max(val_auc, key=val_auc.get), {str(C): round(a, 4) for C, a in val_auc.items()}


# ---------------------------------------------------------------------------------- CTRModel
def tokens(frame: pd.DataFrame, cfg: ModelConfig, drop_fields=()) -> np.ndarray:
    """features.encode, with the `drop_fields` columns set to token 0 (the field carries no information)."""
    from pipelines.model import features

    x = features.encode(frame, cfg)
    for f in drop_fields:
        x[:, FEATURE_FIELDS.index(f)] = 0
    return x


class _Stop(Exception):
    """Raised from an on_epoch callback to end loop.train after the epoch we want."""


def train_base(cand: BaseCandidate, train: pd.DataFrame, val: pd.DataFrame | None = None,
               stop_epoch: int | None = None, seed: int = SEED):
    """Train a CTRModel on `train` under `cand` (cosine schedule over cand.max_epochs).

    With `val`: every epoch is scored on `val` and the weights of the best epoch are returned with
    the per-epoch validation AUCs. With `stop_epoch`: training ends after that epoch (same schedule, so
    a refit reproduces the point selected on validation). Returns (model in eval mode, val AUCs).
    """
    import torch

    from pipelines.model import features
    from pipelines.model.base import CTRModel
    from pipelines.model.inference import predict
    from pipelines.training.loop import LoopSettings, train as loop_train

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

    settings = LoopSettings(epochs=cand.max_epochs, batch_size=cand.batch_size, lr=cand.lr,
                            weight_decay=cand.weight_decay, warmup_steps=cand.warmup_steps, seed=seed)
    try:
        loop_train(model, x, y, settings, desc="bench-base", on_epoch=on_epoch)
    except _Stop:
        pass
    if "weights" in best:
        model.load_state_dict(best["weights"])
    return model.eval(), curve


def predict_base(model, cand: BaseCandidate, frame: pd.DataFrame) -> np.ndarray:
    from pipelines.model.inference import predict

    return predict(model, tokens(frame, cand.model, cand.drop_fields))


def tune_base(fit: pd.DataFrame, val: pd.DataFrame, grid=BASE_GRID, log: list | None = None):
    """Best (candidate, epoch, val AUC, fit-trained model at that epoch) over `grid` x epochs."""
    best = None
    for i, cand in enumerate(grid):
        t = time.perf_counter()
        model, curve = train_base(cand, fit, val=val)
        k = int(np.nanargmax(curve))
        if log is not None:
            log.append({"candidate": i, **cand.describe(), "val_auc_per_epoch": [round(a, 4) for a in curve],
                        "secs": round(time.perf_counter() - t, 1)})
        if best is None or curve[k] > best[2]:
            best = (cand, k + 1, curve[k], model)
    return best


# ------------------------------------------------------------------------------ LoRA per slot
def slot_adapters(base_dir: Path, cand: BaseCandidate, train: pd.DataFrame, test: pd.DataFrame,
                  lcfg: LoraTrainConfig, epochs_by_slot: dict[str, int] | None = None,
                  max_epochs: int = LORA_MAX_EPOCHS, seed: int = SEED) -> tuple[np.ndarray, dict]:
    """One adapter per slot, each on a fresh copy of the base saved in `base_dir`, trained on the
    slot's `train` rows; returns (pCTR for every row of `test`, in order, each row scored by its
    slot's adapter; per-slot info).

    Selection mode (`epochs_by_slot` None; pass validation rows as `test`): each adapter trains
    `max_epochs` and keeps the epoch with the best AUC on its slot's rows, reported as info[slot]
    ["epoch"]. Scoring mode: each adapter stops after its given epoch (same lr schedule).
    A slot with fewer than `lcfg.min_rows` train rows gets no adapter (as in the pipeline): the base
    scores it.
    """
    from pipelines.model import features, store
    from pipelines.model import adapters
    from pipelines.model.inference import predict
    from pipelines.training.loop import LoopSettings, train as loop_train

    out = np.full(len(test), np.nan)
    info: dict = {}
    for slot in sorted(set(test["slot"])):
        tr_rows = train[train["slot"] == slot]
        te_idx = np.flatnonzero((test["slot"] == slot).to_numpy())
        x_te = tokens(test.iloc[te_idx], cand.model, cand.drop_fields)
        base = store.load_base(base_dir)
        if len(tr_rows) < lcfg.min_rows:
            out[te_idx] = predict(base, x_te)
            info[slot] = {"epoch": 0, "train_rows": len(tr_rows)}
            continue
        model = adapters.attach(base, lcfg)
        x_tr, y_tr = tokens(tr_rows, cand.model, cand.drop_fields), features.labels(tr_rows)
        y_te = features.labels(test.iloc[te_idx])
        select = epochs_by_slot is None
        stop = max_epochs if select else epochs_by_slot[slot]
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
        settings = LoopSettings(epochs=max_epochs, batch_size=lcfg.batch_size, lr=lr,
                                weight_decay=lcfg.weight_decay, warmup_steps=lcfg.warmup_steps, seed=seed)
        try:
            loop_train(model, x_tr, y_tr, settings, desc=f"bench-lora-{slot}", on_epoch=on_epoch)
        except _Stop:
            pass
        if select:
            out[te_idx] = best["p"]
            info[slot] = {"epoch": best["epoch"], "train_rows": len(tr_rows),
                          "auc_per_epoch": [round(a, 4) for a in curve]}
        else:
            out[te_idx] = predict(model, x_te)
            info[slot] = {"epoch": stop, "train_rows": len(tr_rows)}
    return out, info


# ------------------------------------------------------------------------------ distilled hook
@dataclass(frozen=True)
class QualityContext:
    """What a fourth row ("distilled adapters", from the cold-start module) gets to work with.

    `base_dir` holds the trained base (store.save_base) refit on `train`; `model_cfg` and
    `drop_fields` say how rows are tokenised for it (`tokens(frame, model_cfg, drop_fields)`).
    `fit_base_dir` holds the same configuration trained on `fit` only, for validation on `val`.
    The callable is called twice: ``fn(ctx, stage="val")`` must return pCTR for every row of `val`
    (using only `fit` and `fit_base_dir`), ``fn(ctx, stage="test")`` for every row of `test` (using
    only `train` and `base_dir`). Returning None for "val" is allowed (then the row cannot be chosen
    as "our best model", but is still reported).
    """

    base_dir: Path
    fit_base_dir: Path
    model_cfg: ModelConfig
    drop_fields: tuple[str, ...]
    train: pd.DataFrame
    test: pd.DataFrame
    fit: pd.DataFrame
    val: pd.DataFrame
    lora_cfg: LoraTrainConfig


DistilledFn = Callable[..., "np.ndarray | None"]


# ------------------------------------------------------------------------------------ driver
def run(distilled: DistilledFn | None = None, frame: pd.DataFrame | None = None,
        base_grid: tuple[BaseCandidate, ...] = BASE_GRID, lr_grid=LR_C_GRID,
        lora_cfg: LoraTrainConfig | None = None, lora_max_epochs: int = LORA_MAX_EPOCHS,
        spread_seeds: int = 3) -> dict:
    """The full comparison on MovieLens-100K (or on `frame`, for tests); returns one JSON-safe dict.

    `distilled`: optional fourth row, see QualityContext. `spread_seeds`: the chosen base
    configuration is also refit with this many other seeds, and their test AUCs are reported
    (``base_seed_spread_*``) so that a difference to LR can be read against seed-to-seed noise; they
    play no part in any choice.
    """
    from pipelines.model import store

    t_start = time.perf_counter()
    if frame is None:
        from pipelines.data import movielens

        frame = movielens.load()
    lcfg = lora_cfg or LoraTrainConfig()
    train, test = temporal_split(frame, TRAIN_FRACTION)
    fit, val = temporal_split(train, 1.0 - VAL_FRACTION)
    cold, val_cold = cold_mask(train, test), cold_mask(fit, val)
    y_test, y_val = test["label"].to_numpy(), val["label"].to_numpy()
    out: dict = {"benchmark": "MovieLens-100K temporal split 80/20: LR one-hot vs CTRModel vs CTRModel+slot LoRA",
                 "rows": len(frame), "train_rows": len(train), "test_rows": len(test), "val_rows": len(val),
                 "test_cold_share": round(float(cold.mean()), 4), "val_cold_share": round(float(val_cold.mean()), 4),
                 "test_label_rate": round(float(y_test.mean()), 4)}
    rows: dict[str, dict] = {}
    val_auc: dict[str, float | None] = {}

    # (i) logistic regression
    t = time.perf_counter()
    C, c_curve = tune_lr(fit, val, lr_grid)
    lr_model = fit_lr(train, C)
    rows["lr"] = scores(y_test, predict_lr(lr_model, test), cold)
    val_auc["lr"] = c_curve[str(C)]
    out.update(lr_C=C, lr_val_auc_by_C=c_curve, lr_secs=round(time.perf_counter() - t, 1))

    # (ii) base CTRModel, full training
    t = time.perf_counter()
    search: list[dict] = []
    cand, epoch, base_val_auc, fit_model = tune_base(fit, val, base_grid, log=search)
    base_model, _ = train_base(cand, train, stop_epoch=epoch)
    rows["base"] = scores(y_test, predict_base(base_model, cand, test), cold)
    val_auc["base"] = round(base_val_auc, 4)
    out.update(base_config=cand.describe(), base_epochs=epoch, base_search=search,
               base_secs=round(time.perf_counter() - t, 1))
    spread = [scores(y_test, predict_base(train_base(cand, train, stop_epoch=epoch, seed=SEED + 1 + i)[0], cand,
                                          test), cold) for i in range(spread_seeds)]
    if spread:
        for k in ("auc", "auc_cold"):
            vals = [rows["base"][k]] + [r[k] for r in spread]
            out[f"base_seed_spread_{k}"] = {"seeds": len(vals), "min": min(vals), "max": max(vals),
                                            "mean": round(float(np.mean(vals)), 4)}

    with tempfile.TemporaryDirectory() as tmp:
        base_dir, fit_base_dir = Path(tmp) / "base", Path(tmp) / "fit_base"
        store.save_base(base_model, base_dir)
        store.save_base(fit_model, fit_base_dir)

        # (iii) base + one LoRA adapter per slot; adapter epochs chosen on validation
        t = time.perf_counter()
        p_val, val_info = slot_adapters(fit_base_dir, cand, fit, val, lcfg, max_epochs=lora_max_epochs)
        epochs_by_slot = {s: i["epoch"] for s, i in val_info.items()}
        p_test, _ = slot_adapters(base_dir, cand, train, test, lcfg, epochs_by_slot=epochs_by_slot,
                                  max_epochs=lora_max_epochs)
        rows["lora"] = scores(y_test, p_test, cold)
        val_auc["lora"] = round(auc(y_val, p_val), 4)
        out.update(lora_epochs_by_slot=epochs_by_slot, lora_val_by_slot=val_info, lora_r=lcfg.r, lora_targets=list(lcfg.target_modules),
                   lora_secs=round(time.perf_counter() - t, 1))

        # (iv) distilled adapters (cold-start module), optional
        if distilled is not None:
            t = time.perf_counter()
            ctx = QualityContext(base_dir=base_dir, fit_base_dir=fit_base_dir, model_cfg=cand.model,
                                 drop_fields=cand.drop_fields, train=train, test=test, fit=fit, val=val,
                                 lora_cfg=lcfg)
            try:
                pv = distilled(ctx, stage="val")
                pt = np.asarray(distilled(ctx, stage="test"), dtype=np.float64)
            except RuntimeError as exc:
                # The optional row cannot be built for this base (reported, the other rows stand).
                out["distilled_error"] = str(exc)
                print(f"bench_quality: distilled row skipped: {exc}", file=sys.stderr)
            else:
                if pt.shape != (len(test),):
                    raise ValueError(f"distilled(stage='test') must return {len(test)} pCTRs, got shape {pt.shape}")
                rows["distilled"] = scores(y_test, pt, cold)
                val_auc["distilled"] = None if pv is None else round(auc(y_val, np.asarray(pv, dtype=np.float64)), 4)
            out["distilled_secs"] = round(time.perf_counter() - t, 1)

    for name, r in rows.items():
        out.update({f"{name}_{k}": v for k, v in r.items()})
        out[f"{name}_val_auc"] = val_auc[name]
    if "distilled" not in rows:
        out.update({f"distilled_{k}": None for k in ("auc", "auc_cold", "auc_warm", "logloss", "val_auc")})

    ours = {k: v for k, v in val_auc.items() if k != "lr" and v is not None}
    best = max(ours, key=ours.get)
    out["best_model"] = best
    out["best_model_chosen_on"] = "validation AUC"
    lr = rows["lr"]
    for name in [k for k in rows if k != "lr"]:
        r = rows[name]
        out[f"{name}_minus_lr_auc"] = round(r["auc"] - lr["auc"], 4)
        out[f"{name}_minus_lr_auc_cold"] = round(r["auc_cold"] - lr["auc_cold"], 4)
    out["goal_best_beats_lr_overall"] = out[f"{best}_minus_lr_auc"] >= GOAL_MARGIN
    out["goal_best_beats_lr_cold"] = out[f"{best}_minus_lr_auc_cold"] >= GOAL_MARGIN
    out["goal_met"] = out["goal_best_beats_lr_overall"] and out["goal_best_beats_lr_cold"]
    out["table"] = {name: {**r, "val_auc": val_auc[name]} for name, r in rows.items()}
    out["wall_s"] = round(time.perf_counter() - t_start, 1)
    return out


def markdown_table(result: dict) -> str:
    lines = ["| model | AUC | AUC cold users | AUC warm users | logloss | val AUC |", "|---|---|---|---|---|---|"]
    for name, r in result["table"].items():
        lines.append(f"| {name} | {r['auc']} | {r['auc_cold']} | {r['auc_warm']} | {r['logloss']} | {r['val_auc']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipelines.bench.quality", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--table", action="store_true", help="also print a markdown table (to stderr)")
    a = p.parse_args(argv)
    from pipelines.bench.quality_distill import make_distilled

    r = run(distilled=make_distilled())
    print(json.dumps(r), flush=True)
    if a.table:
        print(markdown_table(r), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
