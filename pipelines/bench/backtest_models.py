"""The comparators of the backtest: what scores each day's rows, fitted only on the rows before them.

* ``static``: the base (of the configured model family) trained once on the history of the first scored day
  (the cutoff);
* ``full_retrain``: the same base trained from scratch every day on all earlier rows (the cost reference);
* ``adapter``: the static base + one daily LoRA adapter per slot (the config's `lora`, id rows off);
* ``adapter_ids``: daily adapters that learn ids: the config's `lora` if it names `trainable_tokens`,
  otherwise the choice validated on the 46 days before the default range (docs/benchmarks.md): the
  rows of the window's user ids only (`trainable_tokens: [user_id]`, `tokens_only: true`);
* the logistic regressions (``lr_static``, ``lr_daily``, ``lr_delta``): `backtest_lr`.

Bases train as `training.base_model` trains them (`base_training` settings, the config's `model`), on
every history row: the base stage's holdout only monitors the last epoch, it selects nothing, so the
backtest keeps no rows back. An adapter trains on its slot's rows of the `lora.window_days` days before
the day, the newest `lora.val_fraction` of them validating each epoch (early stopping, best epoch kept),
as the adapter stage trains; the evaluation holdout the gate needs is the stage replay's business, not
a comparator's. `cpu_s` counts the process CPU seconds of training only (scoring is not a cost of
retraining), with torch on one thread as the pipeline trains.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from pipelines.bench.backtest_protocol import Backtest, Day
from pipelines.config import LoraTrainConfig, PipelineConfig
from pipelines.data.splits import time_split
from pipelines.model import adapters, family, features
from pipelines.model.inference import predict
from pipelines.training import delta
from pipelines.training import orthogonality as ortho
from pipelines.training.base_fit import fit_base as fit
from pipelines.training.loop import seed_everything, train
from pipelines.training.orthogonality import Regularizer

log = logging.getLogger(__name__)

# chosen on the validation days: item rows and LoRA on q/v, trained with the user rows, cost cold rows AUC
ID_TOKENS = {"trainable_tokens": ("user_id",), "tokens_only": True}


class Comparator:
    """Scores one day at a time, in order; `cpu_s` accumulates training CPU seconds."""

    name = ""

    def __init__(self) -> None:
        self.cpu_s = 0.0

    def predict_day(self, bt: Backtest, day: Day) -> np.ndarray:
        raise NotImplementedError

    def info(self) -> dict:
        return {}

    def _timed(self, fn, *args, **kwargs):
        t = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            self.cpu_s += time.process_time() - t


# ----------------------------------------------------------------------------------- base model
def fit_base(cfg: PipelineConfig, rows: pd.DataFrame, desc: str = "backtest-base"):
    """A base of the configured family, trained on `rows` as the base stage trains one (settings, seed,
    schedule, the wide LR first when `base_training.wide_l2` > 0), in eval mode."""
    bt = cfg.base_training
    rows = rows[rows["event_ts"] >= pd.Timestamp(bt.train_start, tz="UTC")]  # the base window starts there
    seed_everything(bt.seed)
    fam = family.resolve(cfg.model.family)
    model = fam.build(cfg.model)
    fam.load_pretrained(model, cfg.model)
    fit(model, fam.encode(rows, cfg.model), features.labels(rows), bt, desc=desc)
    return model.eval()


def score(model, cfg: PipelineConfig, rows: pd.DataFrame) -> np.ndarray:
    return predict(model, family.encode(rows, cfg.model))


def base_key(cfg: PipelineConfig, history: pd.DataFrame) -> str:
    """What a static base is a function of: the model and base-training settings and the rows before the cutoff."""
    settings = {"model": dataclasses.asdict(cfg.model), "base_training": dataclasses.asdict(cfg.base_training)}
    h = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
    h.update(pd.util.hash_pandas_object(history, index=False).to_numpy().tobytes())
    return h.hexdigest()[:24]


class Static(Comparator):
    """The base frozen at the cutoff; the adapters' base too (`model`). With `cache_dir` the fitted base is
    kept there (keyed by `base_key`) and a later replay with the same settings and history loads it instead
    of fitting it again: the text family's base costs about 20 CPU minutes, and a recipe search replays the
    same base many times. `cpu_s` counts the fit only when it ran."""

    name = "static"

    def __init__(self, cfg: PipelineConfig, cache_dir: str | None = None) -> None:
        super().__init__()
        self.cfg, self.cache_dir = cfg, cache_dir
        self.model = None
        self.loaded_from: str | None = None

    def ensure(self, bt: Backtest):
        if self.model is None:
            t = time.process_time()
            self.model, self.loaded_from = cached_base(
                self.cfg, bt.history(bt.days[0]), self.cache_dir, "backtest-static"
            )
            if self.loaded_from is None:
                self.cpu_s += time.process_time() - t
        return self.model

    def info(self) -> dict:
        return {"base_loaded_from": self.loaded_from} if self.loaded_from else {}

    def predict_day(self, bt: Backtest, day: Day) -> np.ndarray:
        return score(self.ensure(bt), self.cfg, bt.scored(day))


def cached_base(cfg: PipelineConfig, history: pd.DataFrame, cache_dir: str | None, desc: str):
    """(a base fitted on `history`, None), or with `cache_dir` holding one of the same settings and history
    (`base_key`), (that base, its path). A base fitted with `cache_dir` is saved there."""
    path = Path(cache_dir) / f"{cfg.model.family}-{base_key(cfg, history)}.pt" if cache_dir else None
    if path is not None and path.is_file():
        log.info("backtest: base loaded from %s", path)
        return _load_base(cfg, path), str(path)
    model = fit_base(cfg, history, desc)
    if path is not None:
        _save_base(model, path)
    return model, None


def _save_base(model, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    torch.save(model.state_dict(), tmp)
    os.replace(tmp, path)  # a reader never sees half a file


def _load_base(cfg: PipelineConfig, path: Path):
    model = family.resolve(cfg.model.family).build(cfg.model)
    model.load_state_dict(torch.load(path, weights_only=True))
    return model.eval()


class FullRetrain(Comparator):
    name = "full_retrain"

    def __init__(self, cfg: PipelineConfig) -> None:
        super().__init__()
        self.cfg = cfg

    def predict_day(self, bt: Backtest, day: Day) -> np.ndarray:
        model = self._timed(fit_base, self.cfg, bt.history(day), f"backtest-full-{day.date}")
        return score(model, self.cfg, bt.scored(day))


# -------------------------------------------------------------------------------------- adapters
def lora_only_config(lc: LoraTrainConfig) -> LoraTrainConfig:
    """The LoRA recipe (`lora.kind: lora`, the settings' defaults: q/v LoRA per slot on a 28-day window) with
    `lc`'s shape, id rows off: what `adapter_lora` trains whatever kind the config ships."""
    if lc.kind == "lora":
        return dataclasses.replace(lc, trainable_tokens=(), tokens_only=False)
    return LoraTrainConfig(
        r=lc.r,
        alpha=lc.alpha,
        target_modules=lc.target_modules,
        rank_pattern=lc.rank_pattern,
        layers=lc.layers,
        min_rows=lc.min_rows,
        seed=lc.seed,
    )


def id_token_config(lc: LoraTrainConfig) -> LoraTrainConfig:
    """`lc` if it is a LoRA recipe naming `trainable_tokens`, otherwise the LoRA recipe with the validated
    id-row choice (ID_TOKENS)."""
    if lc.kind == "lora" and lc.trainable_tokens:
        return lc
    return dataclasses.replace(lora_only_config(lc), **ID_TOKENS)


class SlotAdapters(Comparator):
    """Adapters trained every morning on `static`'s base. `per_slot` (the pipeline's adapters): one per
    slot on its slot's window rows; otherwise one for every slot on all of the window's rows. Fewer than
    `lora.min_rows` rows: the base scores, as the pipeline leaves such a slot without a candidate."""

    def __init__(
        self, name: str, cfg: PipelineConfig, lora: LoraTrainConfig, static: Static, *, per_slot: bool = True
    ) -> None:
        super().__init__()
        self.name, self.cfg, self.lora, self.static, self.per_slot = name, cfg, lora, static, per_slot
        self.trained = 0
        self.bytes: list[int] = []
        self.token_rows: list[int] = []
        self.latest: dict = {}  # slot -> LoRA factors of its newest adapter (the slot's champion here)
        self.cos: list[float] = []  # each adapter's largest |cos| with the other slots' champions
        self.norms: list[float] = []  # each adapter's ||dW||_F (all modules)

    def predict_day(self, bt: Backtest, day: Day) -> np.ndarray:
        rows = bt.scored(day)
        window = bt.window(day, self.lora.window_days)
        if not self.per_slot:
            return score(self._model(bt, window, day.date), self.cfg, rows)
        out = np.empty(len(rows))
        champions = dict(self.latest)  # this morning's: a slot trained today is no sibling of today's others
        for slot in sorted(set(rows["slot"])):
            at = (rows["slot"] == slot).to_numpy()
            siblings = {s: f for s, f in champions.items() if s != slot}
            model = self._model(bt, window[window["slot"] == slot], f"{day.date}/{slot}", siblings)
            if model is not self.static.ensure(bt):
                self._track(slot, model, siblings)
            out[at] = score(model, self.cfg, rows[at])
        return out

    def _track(self, slot: str, model, siblings: dict) -> None:
        mine = {m: (p.detach().clone(), q.detach().clone()) for m, (p, q) in ortho.live_factors(model).items()}
        cos = ortho.max_abs_cos(mine, siblings)
        if cos is not None:
            self.cos.append(cos)
        self.norms.append(ortho.update_norm(mine))
        self.latest[slot] = mine

    def _model(self, bt: Backtest, train: pd.DataFrame, label: str, siblings: dict | None = None):
        base = self.static.ensure(bt)
        return base if len(train) < self.lora.min_rows else self._timed(self._fit, base, train, label, siblings)

    def _fit(self, base, rows: pd.DataFrame, label: str, siblings: dict | None = None):
        lc = self.lora
        token_rows = None
        if lc.trainable_tokens:  # every id of the adapter's train and val rows, as training.adapter picks them
            token_rows = {t: features.id_buckets(rows[t], t, self.cfg.model) for t in lc.trainable_tokens}
            self.token_rows.append(sum(len(v) for v in token_rows.values()))
        seed_everything(lc.seed)
        model = adapters.attach(copy.deepcopy(base), lc, token_rows=token_rows)
        fit, val = time_split(rows, lc.val_fraction)
        settings = delta.loop_settings(lc)
        enc = self.cfg.model
        ortho = Regularizer(lc.orthogonality_lambda, siblings) if lc.orthogonality_lambda > 0 and siblings else None
        reg = delta.regularizer(lc, len(fit), ortho)
        train(
            model,
            family.encode(fit, enc),
            features.labels(fit),
            settings,
            desc=f"{self.name}-{label}",
            val=(family.encode(val, enc), features.labels(val)) if len(val) else None,
            regularizer=reg,
        )
        self.trained += 1
        self.bytes.append(_saved_bytes(model))
        return model.eval()

    def info(self) -> dict:
        return {
            "adapters_trained": self.trained,
            "per_slot": self.per_slot,
            "cpu_s_per_adapter": round(self.cpu_s / self.trained, 2) if self.trained else None,
            "adapter_bytes": int(np.mean(self.bytes)) if self.bytes else None,
            "token_rows_mean": int(np.mean(self.token_rows)) if self.token_rows else None,
            "lora": {
                "r": self.lora.r,
                "target_modules": list(self.lora.target_modules),
                "trainable_tokens": list(self.lora.trainable_tokens),
                "tokens_only": self.lora.tokens_only,
                "window_days": self.lora.window_days,
                "rank_pattern": dict(self.lora.rank_pattern),
                "layers": list(self.lora.layers),
                "lr": self.lora.stable_lr(),
                "keep_base_if_no_gain": self.lora.keep_base_if_no_gain,
                "orthogonality_lambda": self.lora.orthogonality_lambda,
                "kind": self.lora.kind,
                "delta_l2": self.lora.delta_l2,
            },
            "max_abs_cos": _spread(self.cos),
            "update_norm": _spread(self.norms),
        }


def _spread(values: list[float]) -> dict | None:
    """n, min, median and max of one figure over the adapters (None before there is one)."""
    if not values:
        return None
    return {
        "n": len(values),
        "min": float(np.min(values)),
        "median": float(np.median(values)),
        "max": float(np.max(values)),
    }


def _saved_bytes(model) -> int:
    """Bytes of the adapter as the pipeline stores it (adapters.save: PEFT's files)."""
    with tempfile.TemporaryDirectory() as tmp:
        adapters.save(model, tmp)
        return sum(p.stat().st_size for p in Path(tmp).rglob("*") if p.is_file())
