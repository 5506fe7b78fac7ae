"""Checks of a partition's meaning, for faults that pass the schema and the event-time checks (issue 31).

Each answers "could this partition be what the log says it is?", against the reference window where it
needs one. Pure numpy/pandas, like `drift`; a failing check fails validation (they are not drift: each
looks for something a healthy log does not do at all):

* `item_category_consistency`: an item's category is a property of the item. Rows whose (already seen)
  item carries another category than in the reference mean the item ids were shuffled or mis-joined.
* `replayed_rows`: rows whose (user, item, slot, time of day to the microsecond) already happened in the
  reference: yesterday's rows re-stamped as today. Repeated impressions of an ad to a user are normal in
  ad logs; the same impression at the same microsecond of another day is not.
* `stuck_column[c]`: a feature column holding one value all day, where the reference's value mix makes
  that improbable: P = sum_v share_v ** k < `stuck_column_p`, with k the day's independent units: distinct
  items for item columns, (user, hour) pairs for slot and hour, users for user columns.
* `missing_slot[s]`: a slot of the reference absent all day, where P = (1 - share_s) ** k < `stuck_column_p`.
* `label_leak`: one column alone separating the labels, AUC of the column's per-value click rate on the
  day's own rows >= `max_single_column_auc`: the label leaked into it (MovieLens' highest on a day of
  >= 50 rows: 0.86 before the test period, 0.88 over all its days). Ids are left out: a per-id rate on
  the rows it came from separates by construction.

MovieLens (`docs/benchmarks.md`, fault suite) has no day on which any of them fails.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import pandas as pd

from pipelines.metrics import auc

ITEM_COLUMNS = ("category",)
CONTEXT_COLUMNS = ("slot", "hour")
STUCK_COLUMNS = ("slot", "gender", "age_bucket", "occupation", "category", "hour")
LEAK_COLUMNS = ("slot", "gender", "age_bucket", "occupation", "category", "hour", "weekday")
REPLAY_KEY = ("user_id", "item_id", "slot")


def _replay_keys(frame: pd.DataFrame) -> np.ndarray:
    """A 64-bit hash per row of (user, item, slot, microsecond of the day)."""
    ts = pd.to_datetime(frame["event_ts"], utc=True)
    time_of_day = (ts - ts.dt.floor("D")).dt.total_seconds().mul(1e6).round().astype("int64")
    keys = frame[list(REPLAY_KEY)].astype(str).assign(_t=time_of_day.to_numpy())
    return pd.util.hash_pandas_object(keys, index=False).to_numpy()


def reference(frames: Iterable[pd.DataFrame]) -> dict:
    """What the checks need of the reference window: every item's category, the replay keys, the value
    shares of the stuck-value columns."""
    columns = list(dict.fromkeys([*REPLAY_KEY, "event_ts", *STUCK_COLUMNS]))
    ref = pd.concat([f[columns] for f in frames], ignore_index=True)
    if ref.empty:
        raise ValueError("cannot build a consistency reference from an empty window")
    shares = {c: ref[c].value_counts(normalize=True, dropna=False).to_dict() for c in STUCK_COLUMNS}
    return {
        "item_category": ref.dropna(subset=["category"]).groupby("item_id", observed=True)["category"].last(),
        "replay_keys": np.sort(_replay_keys(ref)),
        "shares": shares,
    }


def _check(name: str, value, limit, passed: bool, expected: str) -> dict:
    return {"check": name, "observed": value, "expected": expected, "threshold": limit, "passed": bool(passed)}


def _category_mismatch(frame: pd.DataFrame, ref: dict, limit: float) -> dict:
    known = frame["item_id"].map(ref["item_category"])
    seen = known.notna() & frame["category"].notna()
    share = float((known[seen].astype(str) != frame["category"][seen].astype(str)).mean()) if seen.any() else 0.0
    return _check(
        "item_category_consistency",
        round(share, 4),
        limit,
        share <= limit,
        f"rows whose item has another category than in the reference <= {limit:.1%}",
    )


def _replayed(frame: pd.DataFrame, ref: dict, limit: float) -> dict:
    seen, keys = ref["replay_keys"], _replay_keys(frame)  # `seen` is sorted: a binary search, not np.isin
    share = float((seen[np.minimum(np.searchsorted(seen, keys), len(seen) - 1)] == keys).mean())
    return _check(
        "replayed_rows",
        round(share, 4),
        limit,
        share <= limit,
        f"rows repeating a reference impression (user, item, slot, time of day) <= {limit:.1%}",
    )


def _units(frame: pd.DataFrame, column: str) -> int:
    """The day's independent draws of `column`: its items, its (user, hour) sessions, or its users."""
    if column in ITEM_COLUMNS:
        return int(frame["item_id"].nunique())
    if column in CONTEXT_COLUMNS:
        return int(len(frame[["user_id", "hour"]].drop_duplicates()))
    return int(frame["user_id"].nunique())


def _stuck(frame: pd.DataFrame, ref: dict, p_min: float) -> list[dict]:
    out = []
    for c in STUCK_COLUMNS:
        shares = ref["shares"][c]
        if frame[c].nunique(dropna=False) != 1 or len(shares) < 2:
            continue
        k = _units(frame, c)
        p = float(sum(s**k for s in shares.values()))
        out.append(
            _check(
                f"stuck_column[{c}]",
                f"{str(frame[c].iloc[0])!r} on all {len(frame)} rows ({k} units)",
                p_min,
                p >= p_min,
                f"P(one value all day | the reference's mix) = {p:.2g} >= {p_min:g}",
            )
        )
    return out


def _missing_slots(frame: pd.DataFrame, ref: dict, slots, p_min: float) -> list[dict]:
    present, k = set(frame["slot"].dropna()), _units(frame, "slot")
    out = []
    for s in slots:
        share = ref["shares"]["slot"].get(s, 0.0)
        if s in present or share == 0.0:
            continue
        p = float((1.0 - share) ** k)
        out.append(
            _check(
                f"missing_slot[{s}]",
                f"no rows ({k} user-hours, reference share {share:.1%})",
                p_min,
                p >= p_min,
                f"P(no row of the slot | the reference's share) = {p:.2g} >= {p_min:g}",
            )
        )
    return out


def _click_rate(column: pd.Series, y: np.ndarray) -> np.ndarray:
    """Each row's click rate among the rows with its value of `column` (a null is a value)."""
    codes = pd.factorize(column, use_na_sentinel=False)[0]
    return (np.bincount(codes, weights=y) / np.bincount(codes))[codes]


def _leaks(frame: pd.DataFrame, limit: float, min_rows: int) -> list[dict]:
    """The column whose per-value click rate best separates the day's labels (none below `min_rows`)."""
    y = frame["label"].to_numpy(dtype=np.float64)
    if len(frame) < min_rows or set(np.unique(y).tolist()) != {0.0, 1.0}:  # bad labels fail their own checks
        return []
    aucs = {c: float(auc(y, _click_rate(frame[c], y))) for c in LEAK_COLUMNS}
    worst = max(aucs, key=aucs.get)
    return [
        _check(
            "label_leak",
            {"column": worst, "auc": round(aucs[worst], 4)},
            limit,
            aucs[worst] < limit,
            f"AUC of the label from any one column's click rate < {limit} (else the label leaked into it)",
        )
    ]


def consistency_checks(
    frame: pd.DataFrame,
    ref: dict | None,
    *,
    slots,
    max_item_category_mismatch: float,
    max_replayed_fraction: float,
    stuck_column_p: float,
    max_single_column_auc: float,
    leak_min_rows: int,
) -> list[dict]:
    """Every check on `frame` (a partition that passed the contract's column and type checks); with no
    reference (the first partitions) only the label-leak check runs. Checks that cannot fail on this
    partition (a column with several values) are left out: each entry is a measurement."""
    checks = _leaks(frame, max_single_column_auc, leak_min_rows)
    if ref is None or frame.empty:
        return checks
    return [
        _category_mismatch(frame, ref, max_item_category_mismatch),
        _replayed(frame, ref, max_replayed_fraction),
        *_stuck(frame, ref, stuck_column_p),
        *_missing_slots(frame, ref, slots, stuck_column_p),
        *checks,
    ]
