"""The protocol every row of the retired quality benchmarks is measured under (`research.quality`,
`research.quality_headroom`, `research.quality_distill`), and its reference row.

* the split: `temporal_split` by event time (train = earliest `TRAIN_FRACTION`; validation = the
  latest `VAL_FRACTION` of the train part, "fit" = the rest), which the backtest still cuts its log
  with and so owns (`pipelines.bench.backtest_protocol`), and `cold_mask` (rows whose user has no
  event in the training part);
* the metrics of one row: `scores` (AUC overall, on cold-user rows, on warm-user rows; logloss);
* the reference every row is compared with: the backtest's one-hot logistic regression
  (`pipelines.bench.backtest_lr`: `fit_lr` / `predict_lr`, C chosen on validation by `tune_lr`), and
  `GOAL_MARGIN`, the AUC a row must gain over it;
* how rows become CTRModel inputs (`tokens`), and what an optional "distilled" row gets to work
  with (`QualityContext`).

It imports no other research module, so the quality modules can all share it without a cycle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

from pipelines.config import LoraTrainConfig, ModelConfig
from pipelines.data.schema import FEATURE_FIELDS
from pipelines.metrics import auc, logloss
from pipelines.model import features

GOAL_MARGIN = 0.01
SEED = 7


# ------------------------------------------------------------------------------- cold rows
def cold_mask(train: pd.DataFrame, frame: pd.DataFrame) -> np.ndarray:
    """True for rows of `frame` whose user has no event in `train`."""
    return ~frame["user_id"].isin(set(train["user_id"])).to_numpy()


def scores(y: np.ndarray, p: np.ndarray, cold: np.ndarray) -> dict:
    """AUC overall / on cold rows / on warm rows and logloss, rounded to 4 digits (None where undefined)."""

    def clean(v: float):
        return None if v is None or (isinstance(v, float) and math.isnan(v)) else round(float(v), 4)

    return {
        "auc": clean(auc(y, p)),
        "auc_cold": clean(auc(y[cold], p[cold])),
        "auc_warm": clean(auc(y[~cold], p[~cold])),
        "logloss": clean(logloss(y, p)),
    }


# ---------------------------------------------------------------------------------- CTRModel
def tokens(frame: pd.DataFrame, cfg: ModelConfig, drop_fields=()) -> np.ndarray:
    """features.encode, with the `drop_fields` columns set to token 0 (the field carries no information)."""
    x = features.encode(frame, cfg)
    for f in drop_fields:
        x[:, FEATURE_FIELDS.index(f)] = 0
    return x


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
