"""Feature encoding: contract rows -> one token id per field.

Hashing (not a fitted vocabulary) so that any id, including one never seen in training, maps to a
row of the field's table without state to ship next to the model; `pd.util.hash_array` is
deterministic across processes and platforms (fixed SipHash key).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from pipelines.config import ModelConfig
from pipelines.data.schema import FEATURE_FIELDS

ID_FIELDS = ("user_id", "item_id")
INT_FIELDS = ("hour", "weekday")


def field_sizes(cfg: ModelConfig) -> dict[str, int]:
    """The rows of each field's embedding table."""
    return {f: (cfg.id_buckets if f in ID_FIELDS else cfg.small_buckets) for f in FEATURE_FIELDS}


def token_sizes(cfg: ModelConfig) -> dict[str, int]:
    """The range of each field's token, and the rows of its wide table: an id field's `wide_id_buckets`
    when set (its embedding reads the token modulo `id_buckets`), else `field_sizes`."""
    sizes = field_sizes(cfg)
    if cfg.wide and cfg.wide_id_buckets:
        sizes.update({f: cfg.wide_id_buckets for f in ID_FIELDS})
    return sizes


def _hash_bucket(values: pd.Series, buckets: int) -> np.ndarray:
    arr = values.astype("string").fillna("<null>").to_numpy(dtype=object)
    return (pd.util.hash_array(arr) % np.uint64(buckets)).astype(np.int64)


def id_buckets(values: pd.Series, field: str, cfg: ModelConfig) -> list[int]:
    """The sorted distinct tokens of id field `field` that `values` hash to: the rows of its wide table an
    adapter with trainable token rows trains for these ids (its embedding rows: these modulo
    `id_buckets`; model.adapters.token_targets)."""
    if field not in ID_FIELDS:
        raise ValueError(f"{field} is not an id field ({ID_FIELDS})")
    return sorted(int(b) for b in np.unique(_hash_bucket(values, token_sizes(cfg)[field])))


def encode(frame: pd.DataFrame, cfg: ModelConfig) -> np.ndarray:
    """Return an int64 array [rows, len(FEATURE_FIELDS)] of per-field token ids (`token_sizes`)."""
    sizes = token_sizes(cfg)
    cols = []
    for f in FEATURE_FIELDS:
        if f in INT_FIELDS:
            cols.append(np.clip(frame[f].to_numpy(dtype=np.int64), 0, sizes[f] - 1))
        else:
            cols.append(_hash_bucket(frame[f], sizes[f]))
    return np.stack(cols, axis=1)


def labels(frame: pd.DataFrame) -> np.ndarray:
    return frame["label"].to_numpy(dtype=np.float32)
