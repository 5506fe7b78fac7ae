"""Distribution drift of a new click-log partition against a reference window (the trailing N validated
partitions), for the data-validation stage. Pure numpy/pandas: a 1M-row partition against a 5M-row
reference takes about a second, reference profiling included.

* Categorical columns: population stability index (PSI) of the value mix against the reference;
  ad-tech reading: < 0.1 no real change, 0.1-0.2 small, > 0.2 significant (the default threshold).
* Numeric columns are small integer domains (hour 0-23, weekday 0-6), so their sketch is the exact
  histogram (every value plus one overflow bin for out-of-domain/null values): PSI and a KS statistic
  come out with no approximation.
* weekday is constant within a daily partition, so its raw mix against a multi-day window (or against
  yesterday) always "drifts"; what can go wrong is its relation to the calendar. Its histogram is
  therefore of the offset (weekday - UTC weekday of event_ts) mod 7: a healthy log is all 0, a
  convention bug (Sunday=0, local time) moves the mass and fails the check.
* Unseen ids (users/items absent from the reference) are reported, never failed: cold start is normal.
"""

from __future__ import annotations

import base64
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np
import pandas as pd

CATEGORICAL = ("slot", "gender", "age_bucket", "category")
NUMERIC = ("hour", "weekday")
NUMERIC_BINS = {"hour": 24, "weekday": 7}  # values 0..n-1; bin n takes out-of-domain and nulls
ID_COLUMNS = ("user_id", "item_id")
NULL = "<null>"
DEFAULT_MAX_IDS = 1 << 18  # per id column: 2 MiB of hashes, ~2.8 MB in JSON
_THURSDAY = 3  # 1970-01-01, day 0 of the epoch, was a Thursday (Monday = 0)


@dataclass(frozen=True)
class IdSketch:
    """The ids of the reference as sorted 64-bit hashes (pandas' SipHash with its fixed key, so stable
    across processes): all of them while there are at most `cap` distinct ids, else the `cap` smallest
    hashes (a bottom-k sample, `sampled` = True).

    Error. Exact regime: an unseen id is taken for a seen one only on a 64-bit collision, probability
    <= cap / 2**64 (~1e-14) per id. Sampled regime: only rows whose id hash is <= the largest kept hash
    are judged; that is a uniform sample of ids (fraction cap / distinct ids), the same hash for seen and
    new ids, so the rate is unbiased, with the sampling error of the rows those ids carry: large when a
    few heavy ids carry much traffic. Measured on the synthetic log (Zipf users), std of the user rate:
    0.017 keeping 7 % of the ids, 0.011 at 13 %, 0.004 at 30 %. A reference id is never reported unseen.
    """

    hashes: bytes = field(repr=False)  # little-endian uint64, sorted, unique; bytes keep it immutable, comparable
    cap: int
    sampled: bool

    @property
    def array(self) -> np.ndarray:
        return np.frombuffer(self.hashes, dtype="<u8")

    def unseen_rate(self, ids: pd.Series) -> float | None:
        """Fraction of rows whose id is not in the reference (None when no row can be judged)."""
        codes, h = _hash_ids(ids)
        rows = np.bincount(codes, minlength=len(h))
        ref = self.array  # never empty: profile() refuses an empty window, and null ids count as "<null>"
        pos = np.minimum(np.searchsorted(ref, h), len(ref) - 1)
        seen = ref[pos] == h
        judged = h <= ref[-1] if self.sampled else np.ones(len(h), dtype=bool)
        total = int(rows[judged].sum())
        return float(rows[judged & ~seen].sum() / total) if total else None

    def to_json(self) -> dict:
        return {
            "cap": self.cap,
            "sampled": self.sampled,
            "count": len(self.array),
            "hashes_u64le_b64": base64.b64encode(self.hashes).decode("ascii"),
        }

    @classmethod
    def from_json(cls, d: dict) -> "IdSketch":
        return cls(hashes=base64.b64decode(d["hashes_u64le_b64"]), cap=int(d["cap"]), sampled=bool(d["sampled"]))


@dataclass(frozen=True)
class ReferenceProfile:
    """Compact, JSON-serialisable summary of the reference window: stored next to the partitions, it is
    reused without re-reading the reference rows.

    numeric[c] is the exact histogram of column c (for weekday: of its offset to the calendar, see the
    module doc) as frequencies over NUMERIC_BINS[c] + 1 bins, the last one for out-of-domain/null values.
    partitions counts the distinct UTC dates of event_ts (the lake partitions by day).
    """

    rows: int
    partitions: int
    categorical: dict[str, dict[str, float]]
    numeric: dict[str, list[float]]
    user_ids: IdSketch
    item_ids: IdSketch

    def to_json(self) -> dict:
        return {
            "version": 1,
            "rows": self.rows,
            "partitions": self.partitions,
            "categorical": self.categorical,
            "numeric": self.numeric,
            "user_ids": self.user_ids.to_json(),
            "item_ids": self.item_ids.to_json(),
        }

    @classmethod
    def from_json(cls, d: dict) -> "ReferenceProfile":
        if d.get("version") != 1:
            raise ValueError(f"unsupported reference profile version {d.get('version')!r}")
        return cls(
            rows=int(d["rows"]),
            partitions=int(d["partitions"]),
            categorical={c: {str(k): float(v) for k, v in f.items()} for c, f in d["categorical"].items()},
            numeric={c: [float(v) for v in f] for c, f in d["numeric"].items()},
            user_ids=IdSketch.from_json(d["user_ids"]),
            item_ids=IdSketch.from_json(d["item_ids"]),
        )


# ------------------------------------------------------------------------------------ per-frame pieces
def _counts(s: pd.Series) -> dict[str, int]:
    vc = s.value_counts(dropna=False, sort=False)
    return {NULL if pd.isna(k) else str(k): int(n) for k, n in vc.items()}


def _days(ts: pd.Series) -> tuple[np.ndarray, np.ndarray]:
    """(UTC day number of each event, days since 1970-01-01; mask of null timestamps)."""
    d = pd.to_datetime(ts, utc=True).dt.tz_localize(None).to_numpy().astype("datetime64[D]")
    return d.astype(np.int64), np.isnat(d)


def _as_int(values) -> np.ndarray:
    """int64 values; -1 (outside every domain) for nulls and non-integral values. Integer input skips floats."""
    v = np.asarray(values)
    if v.dtype.kind in "iu":
        return v.astype(np.int64)
    v = np.clip(np.asarray(v, dtype=np.float64), -1, 2**31)  # clip: huge floats must not wrap into the domain
    return np.where(v == np.floor(v), v, -1).astype(np.int64)  # NaN == NaN is False


def _numeric_values(frame: pd.DataFrame, col: str, days: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    s = frame[col]
    v = _as_int(s.to_numpy() if isinstance(s.dtype, np.dtype) else s.to_numpy(dtype=np.float64, na_value=np.nan))
    if col == "weekday":
        # Offset to the calendar (numpy's % is non-negative here); invalid weekdays stay out of domain.
        day, nat = days
        v = np.where((v >= 0) & (v < 7) & ~nat, (v - (day + _THURSDAY)) % 7, -1)
    return v


def _histogram(values, bins: int) -> np.ndarray:
    v = _as_int(values)
    return np.bincount(np.where((v >= 0) & (v < bins), v, bins), minlength=bins + 1)


def _hash_ids(ids: pd.Series) -> tuple[np.ndarray, np.ndarray]:
    """(row -> unique code, uint64 hash per unique id): hashing the uniques only is what makes 5M rows cheap."""
    codes, uniques = pd.factorize(ids, use_na_sentinel=False)
    u = np.asarray(uniques, dtype=object)
    u[pd.isna(u)] = NULL  # a null id is the id "<null>", as in the categorical mixes
    return codes, pd.util.hash_array(u, categorize=False)  # non-str ids are hashed as str(id) by pandas


def _bottom_k(cur: np.ndarray, new: np.ndarray, cap: int, sampled: bool) -> tuple[np.ndarray, bool]:
    """Merge hashes into the running sketch; bottom-k of a union = bottom-k of (bottom-k of the prefix
    and the new ones), so streaming gives exactly the sketch of the concatenation."""
    if sampled:
        new = new[new <= cur[-1]]
    merged = np.sort(np.concatenate([cur, new]))  # a sort + adjacent dedupe is cheaper than np.union1d here
    merged = merged[np.r_[True, merged[1:] != merged[:-1]]] if len(merged) else merged
    return (merged[:cap], True) if len(merged) > cap else (merged, sampled)


def profile(frames: Iterable[pd.DataFrame], *, max_ids: int = DEFAULT_MAX_IDS) -> ReferenceProfile:
    """Profile the reference window one frame at a time (counts are summed, never the rows concatenated)."""
    if max_ids < 1:
        raise ValueError(f"max_ids must be >= 1, got {max_ids}")
    rows, days_seen = 0, set()
    cats = {c: Counter() for c in CATEGORICAL}
    nums = {c: np.zeros(NUMERIC_BINS[c] + 1, dtype=np.int64) for c in NUMERIC}
    ids = {c: (np.empty(0, dtype=np.uint64), False) for c in ID_COLUMNS}
    for frame in frames:
        if len(frame) == 0:
            continue
        rows += len(frame)
        for c in CATEGORICAL:
            cats[c].update(_counts(frame[c]))
        days = _days(frame["event_ts"])
        d = days[0][~days[1]]
        if len(d):  # bincount over the day range: far cheaper than np.unique on every row
            days_seen.update((np.flatnonzero(np.bincount(d - d.min())) + d.min()).tolist())
        for c in NUMERIC:
            nums[c] += _histogram(_numeric_values(frame, c, days), NUMERIC_BINS[c])
        for c in ID_COLUMNS:
            cur, sampled = ids[c]
            ids[c] = _bottom_k(cur, _hash_ids(frame[c])[1], max_ids, sampled)
    if rows == 0:
        raise ValueError("cannot profile an empty reference window")
    sketches = {c: IdSketch(hashes=h.astype("<u8").tobytes(), cap=max_ids, sampled=s) for c, (h, s) in ids.items()}
    return ReferenceProfile(
        rows=rows,
        partitions=len(days_seen),
        categorical={c: {k: n / rows for k, n in sorted(cats[c].items())} for c in CATEGORICAL},
        numeric={c: (nums[c] / rows).tolist() for c in NUMERIC},
        user_ids=sketches["user_id"],
        item_ids=sketches["item_id"],
    )


# ------------------------------------------------------------------------------------ statistics
def _aligned(p: dict, q: dict) -> tuple[np.ndarray, np.ndarray]:
    keys = sorted(set(p) | set(q), key=str)
    out = []
    for d in (p, q):
        v = np.array([float(d.get(k, 0.0)) for k in keys])
        if not v.sum() > 0:
            raise ValueError("empty distribution")
        out.append(v / v.sum())  # accept counts as well as frequencies
    return out[0], out[1]


def _psi(e: np.ndarray, a: np.ndarray, eps: float) -> float:
    # Flooring at eps keeps a category absent on one side finite (ln(a/eps) instead of ln(a/0)) and leaves
    # bins empty on both sides at exactly 0.
    e, a = np.maximum(e, eps), np.maximum(a, eps)
    return float(np.sum((a - e) * np.log(a / e)))


def psi(expected: dict[str, float], actual: dict[str, float], eps: float = 1e-4) -> float:
    """Population stability index sum((a - e) ln(a / e)) over the union of categories, shares floored at eps."""
    return _psi(*_aligned(expected, actual), eps)


def numeric_drift(ref_sketch: list[float], values: np.ndarray, eps: float = 1e-4) -> dict:
    """PSI over the reference histogram's bins, and the KS statistic max |CDF_ref - CDF_new| on them."""
    e = np.asarray(ref_sketch, dtype=np.float64)
    counts = _histogram(values, len(e) - 1)
    if counts.sum() == 0:
        raise ValueError("no values")
    a = counts / counts.sum()
    ks = float(np.max(np.abs(np.cumsum(e) - np.cumsum(a))))
    return {"psi": _psi(e, a, eps), "statistic": ks}


def _non_null_psi(expected: dict, actual: dict) -> float:
    """PSI of the non-null mixes: null fractions have their own budget (max_null_fraction_side), and
    counting `<null>` as a category here would fail drift long before that budget is spent."""
    e = {k: v for k, v in expected.items() if k != NULL}
    a = {k: v for k, v in actual.items() if k != NULL}
    return psi(e, a) if e and a else 0.0


def _check(col: str, value: float, limit: float) -> dict:
    return {
        "check": f"drift_psi({col})",
        "observed": round(value, 4),
        "expected": f"<= {limit}",
        "passed": bool(value <= limit),
    }


def drift_checks(
    frame: pd.DataFrame, ref: ReferenceProfile, *, psi_max: float = 0.2, numeric_psi_max: float = 0.2
) -> dict:
    """One PSI check per CATEGORICAL and NUMERIC column, plus the unseen-id rates (reported, never failed).

    Run it on a partition that passed the contract suite: a missing column raises KeyError.
    """
    if len(frame) == 0:
        raise ValueError("cannot check drift of an empty frame")
    checks = [_check(c, _non_null_psi(ref.categorical[c], _counts(frame[c])), psi_max) for c in CATEGORICAL]
    days = _days(frame["event_ts"])
    checks += [
        _check(c, numeric_drift(ref.numeric[c], _numeric_values(frame, c, days))["psi"], numeric_psi_max)
        for c in NUMERIC
    ]
    unseen = {
        "user_rate": ref.user_ids.unseen_rate(frame["user_id"]),
        "item_rate": ref.item_ids.unseen_rate(frame["item_id"]),
        "rows": int(len(frame)),
    }
    return {"checks": checks, "unseen": unseen}
