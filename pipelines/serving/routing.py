"""Routing: which `<model>:<version>` scores each request row.

A `RoutingTable` is immutable: a refresh builds a new one and the server swaps one reference, so a
request that started on the old table finishes on it. Rules, per row:

1. model: `ctr_lora_cold_start` when the row's user is new and that model has a champion, else
   `<prefix><slot>`;
2. alias: `@canary` when the user falls in the canary share and the model has a canary, else
   `@champion`;
3. no route for the model (slot without an adapter, unknown slot): the base's output, reported as the
   base's own `<model>:<version>`.

The canary share is a stable hash of user_id (`pd.util.hash_array`, fixed key: the same in every
process and on every platform), bucketed mod 10,000: a user is in or out for every request and every
model. The hash key differs from the feature encoder's so canary users are not an embedding bucket.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from pipelines.serving.loader import CANARY, CHAMPION

CANARY_BUCKETS = 10_000
_CANARY_HASH_KEY = "ctr-canary-route"  # 16 bytes, as pd.util.hash_array requires

NewUsers = str | Callable[[pd.DataFrame], np.ndarray]


@dataclass(frozen=True)
class RoutingTable:
    """routes: (model, alias) -> version key; adapters: the keys in stack order (stack row i+1);
    stacks: the LoRA weights of those adapters per layer and model: the module tree that serves them
    (see serving.batched), both owned by this table and never modified; base: the `BaseStore` of the
    base they were trained on (its cfg encodes the request)."""

    generation: int
    base_key: str
    routes: Mapping[tuple[str, str], str]
    adapters: tuple[str, ...] = ()
    stacks: Mapping[str, object] = field(default_factory=dict)
    model: object = None
    base: object = field(default=None, compare=False)

    def keys(self) -> frozenset[str]:
        """The adapter version keys this table can send a row to."""
        return frozenset(self.routes.values())

    def lookup(self, model: str, alias: str) -> str | None:
        return self.routes.get((model, alias))

    def stack_rows(self, keys: np.ndarray) -> np.ndarray:
        """int64 stack row of each version key (0 = the base: no LoRA term)."""
        index = {k: i for i, k in enumerate(self.adapters, start=1)}
        codes, uniques = pd.factorize(keys)
        return np.array([index.get(k, 0) for k in uniques], dtype=np.int64)[codes]

    def describe(self) -> dict[str, str]:
        """{"<model>@<alias>": "<model>:<version>"}, JSON-safe."""
        return {f"{m}@{a}": k for (m, a), k in sorted(self.routes.items())}


def _strings(values: pd.Series) -> np.ndarray:
    """Object array of str (nulls as "<null>"); cheaper than astype("string"), which copies twice."""
    if not (isinstance(values.dtype, pd.StringDtype) or pd.api.types.is_string_dtype(values)):  # object: inferred
        values = values.astype(str)
    return values.to_numpy(dtype=object, na_value="<null>")


def canary_mask(user_ids: pd.Series, share: float) -> np.ndarray:
    """True for the users in the canary share; the same users for the same share, always."""
    if share <= 0.0:
        return np.zeros(len(user_ids), dtype=bool)
    # categorize=False: same hashes, no factorize pass (a request rarely repeats a user)
    hashes = pd.util.hash_array(_strings(user_ids), hash_key=_CANARY_HASH_KEY, categorize=False)
    buckets = hashes % np.uint64(CANARY_BUCKETS)
    return buckets < np.uint64(round(share * CANARY_BUCKETS))


def new_user_mask(frame: pd.DataFrame, new_users: NewUsers | None) -> np.ndarray:
    """Rows whose user is new: a boolean column (absent = nobody new) or a callable over the frame."""
    if new_users is None:
        return np.zeros(len(frame), dtype=bool)
    if callable(new_users):
        mask = np.asarray(new_users(frame), dtype=bool)
        if mask.shape != (len(frame),):
            raise ValueError(f"new_users callable returned shape {mask.shape}, expected ({len(frame)},)")
        return mask
    if new_users not in frame.columns:
        return np.zeros(len(frame), dtype=bool)
    return frame[new_users].to_numpy(dtype=bool, na_value=False)


def _model_keys(table: RoutingTable, model: str) -> tuple[str, str]:
    """(champion key, canary key) of one model; the base when it has no champion."""
    champion = table.lookup(model, CHAMPION) or table.base_key
    return champion, table.lookup(model, CANARY) or champion


def assign(
    table: RoutingTable,
    frame: pd.DataFrame,
    *,
    prefix: str,
    cold_model: str | None,
    canary: np.ndarray,
    new: np.ndarray,
) -> np.ndarray:
    """The version key (object array) that scores each row of `frame`, in row order."""
    codes, uniques = pd.factorize(_strings(frame["slot"]))
    pairs = [_model_keys(table, prefix + s) for s in uniques]
    champion = np.array([p[0] for p in pairs], dtype=object)[codes]
    on_canary = np.array([p[1] for p in pairs], dtype=object)[codes]
    if cold_model is not None and table.lookup(cold_model, CHAMPION) is not None and new.any():
        cold_champion, cold_canary = _model_keys(table, cold_model)
        champion = np.where(new, cold_champion, champion)
        on_canary = np.where(new, cold_canary, on_canary)
    return np.where(canary, on_canary, champion)
