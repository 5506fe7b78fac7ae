"""Seeded synthetic ad logs: impressions of advertisers' creatives in three ad slots, as contract rows.

The world, fixed by `SyntheticSpec` (and its seed):

* slots `feed`, `search`, `splash`, drawn with `slot_mix`; each has its own base CTR (`slot_ctr`,
  defaults ~3.5 %, ~7 %, ~1.5 %) and its own sensitivity to relevance (search > feed > splash);
* users with an age bucket, gender and occupation (MovieLens vocabulary, occupation correlated
  with age), a personal click propensity and two favourite categories;
* advertisers, each with a main vertical (category) and a quality; items are their creatives, in the
  advertiser's vertical most of the time, each with its own quality. Advertiser size is Zipf-like;
* popularity: user and item traffic are Zipf-like over ranks (`user_zipf`, `item_zipf`);
* the click is drawn from a hidden logistic model: slot intercept + slot scale x (user bias + item and
  advertiser quality + demographic x category affinities + favourite-category bonus) + hour of day.
  Intercepts are calibrated once per spec so the realised CTR of each slot is close to `slot_ctr`;
* cold start: day 0 is `origin_day`. From day 1 on, a fraction `new_entity_rate` of each day's rows
  comes from users born that day, and (independently) the same fraction from items born that day;
  ids born on day d > 0 never occur before day d. Cohorts born in the previous 28 days keep getting a
  share of the traffic, so yesterday's new users come back.

Every entity's attributes are a hash of (seed, entity index): they are the same on every day
without keeping any table in memory (vocabularies, attributes and the click model live in
`pipelines.data.synthetic_world`; this module draws the traffic and writes it). Rows of a day come
from RNG streams keyed by (seed, day, block) in fixed blocks of 65,536 rows, so a day's rows do not
depend on which other days are generated nor on `chunk_rows`. Event times are uniform over the UTC
day and come out sorted.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from tqdm.auto import tqdm

from pipelines.data import commit, schema
from pipelines.data.lake import Lake
from pipelines.data.synthetic_world import (
    AGE_BUCKETS,
    CATEGORIES,
    GENDERS,
    OCCUPATIONS,
    SLOT_SCALE,
    SLOTS,
    World,
    calibrated_world,
    categorical,
    item_attrs,
    relevance,
    sigmoid,
    user_attrs,
    zipf_rank,
)
from pipelines.errors import ConfigError

_BLOCK = 1 << 16  # rows per RNG block; fixed so output is independent of chunk_rows
_DAY_US = 86_400_000_000
_RETAIN_DAYS = 28  # cohorts born in the last 28 days keep coming back ...
_RETAIN_WEIGHT = 0.3  # ... each with 30 % of the traffic it had on its birth day
_RETAIN_CAP = 0.5  # returning cohorts take at most half the (non-fresh) traffic


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _parse_day(value: str, what: str) -> dt.date:
    try:
        return dt.date.fromisoformat(str(value))
    except ValueError as exc:
        raise ConfigError(f"{what} must be an ISO date YYYY-MM-DD, got {value!r}") from exc


@dataclass(frozen=True)
class SyntheticSpec:
    """Parameters of the synthetic ad world. Hashable; lists given for the tuple fields become tuples."""

    n_users: int = 200_000
    n_items: int = 20_000
    n_advertisers: int = 1_000
    new_entity_rate: float = 0.05  # share of a day's rows from users (resp. items) born that day
    new_users_per_day: int = 5_000
    new_items_per_day: int = 500
    slot_mix: tuple[float, float, float] = (0.6, 0.3, 0.1)  # share of impressions per SLOTS entry
    slot_ctr: tuple[float, float, float] = (0.035, 0.07, 0.015)  # target CTR per SLOTS entry
    user_zipf: float = 0.8
    item_zipf: float = 0.9
    origin_day: str = "2024-01-01"  # day 0: every id born later is a cold-start id
    seed: int = 0

    def __post_init__(self):
        for name in ("slot_mix", "slot_ctr"):
            value = getattr(self, name)
            if isinstance(value, (list, np.ndarray)):
                object.__setattr__(self, name, tuple(float(v) for v in value))
        for name in ("n_users", "n_items", "n_advertisers"):
            v = getattr(self, name)
            _check(_is_int(v) and v >= 1, f"synthetic.{name} must be an integer >= 1, got {v!r}")
        for name in ("new_users_per_day", "new_items_per_day"):
            v = getattr(self, name)
            _check(_is_int(v) and v >= 0, f"synthetic.{name} must be an integer >= 0, got {v!r}")
        r = self.new_entity_rate
        _check(
            isinstance(r, (int, float)) and not isinstance(r, bool) and 0.0 <= r < 1.0,
            f"synthetic.new_entity_rate must be a number in [0, 1), got {r!r}",
        )
        if r > 0:
            _check(
                self.new_users_per_day >= 1 and self.new_items_per_day >= 1,
                "synthetic.new_users_per_day and new_items_per_day must be >= 1 when new_entity_rate > 0, "
                f"got {self.new_users_per_day} and {self.new_items_per_day}",
            )
        for name in ("slot_mix", "slot_ctr"):
            value = getattr(self, name)
            _check(
                isinstance(value, tuple)
                and len(value) == len(SLOTS)
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value),
                f"synthetic.{name} must be {len(SLOTS)} numbers, one per slot {SLOTS}, got {value!r}",
            )
        _check(
            all(v >= 0 for v in self.slot_mix) and abs(sum(self.slot_mix) - 1.0) < 1e-6,
            f"synthetic.slot_mix must be non-negative and sum to 1, got {self.slot_mix!r} "
            f"(sum {sum(self.slot_mix):.6g})",
        )
        _check(
            all(0.0 < v < 0.5 for v in self.slot_ctr),
            f"synthetic.slot_ctr values must be in (0, 0.5), got {self.slot_ctr!r}",
        )
        for name in ("user_zipf", "item_zipf"):
            v = getattr(self, name)
            _check(
                isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 < v <= 3.0,
                f"synthetic.{name} must be a number in (0, 3], got {v!r}",
            )
        _parse_day(self.origin_day, "synthetic.origin_day")
        _check(
            _is_int(self.seed) and 0 <= self.seed < 2**63,
            f"synthetic.seed must be an integer in [0, 2**63), got {self.seed!r}",
        )

    def day_index(self, day: str) -> int:
        """Days since origin_day (day 0). Days before the origin are refused."""
        idx = (_parse_day(day, "day") - _parse_day(self.origin_day, "synthetic.origin_day")).days
        _check(idx >= 0, f"day {day} is before synthetic.origin_day {self.origin_day}")
        return idx


# ---------------------------------------------------------------------------------- traffic
def _draw_entities(
    rng: np.random.Generator, n: int, day_idx: int, spec: SyntheticSpec, n_base: int, per_day: int, zipf: float
) -> np.ndarray:
    """Global entity indices: base entities are [0, n_base); those born on day b >= 1 follow in blocks of per_day."""
    u_kind, u_born, u_rank = rng.random(n), rng.random(n), rng.random(n)
    out = zipf_rank(u_rank, n_base, zipf)
    if day_idx == 0 or spec.new_entity_rate == 0.0:
        return out
    rate = spec.new_entity_rate
    fresh = u_kind < rate
    out[fresh] = n_base + (day_idx - 1) * per_day + zipf_rank(u_rank[fresh], per_day, zipf)
    cohorts = min(day_idx - 1, _RETAIN_DAYS)
    if cohorts > 0:
        p_ret = min(_RETAIN_CAP, _RETAIN_WEIGHT * rate * cohorts)
        ret = (u_kind >= rate) & (u_kind < rate + (1.0 - rate) * p_ret)
        born = day_idx - 1 - np.minimum((u_born[ret] * cohorts).astype(np.int64), cohorts - 1)
        out[ret] = n_base + (born - 1) * per_day + zipf_rank(u_rank[ret], per_day, zipf)
    return out


def _block(spec: SyntheticSpec, world: World, day_ord: int, day_idx: int, b: int, rows: int) -> dict:
    """Rows [b * _BLOCK, min((b + 1) * _BLOCK, rows)) of a day, as integer/float arrays."""
    lo, hi = b * _BLOCK, min((b + 1) * _BLOCK, rows)
    n = hi - lo
    rng = np.random.default_rng(np.random.SeedSequence(spec.seed, spawn_key=(1, day_ord, b)))
    # Stratified over the day: block b covers the time span of its row range, so the day comes out sorted
    # and is uniform over [00:00, 24:00) UTC as a whole.
    t_lo, t_hi = (lo * _DAY_US) // rows, (hi * _DAY_US) // rows
    t = np.sort(rng.integers(t_lo, max(t_hi, t_lo + 1), n))
    slot = categorical(rng.random(n), np.asarray(spec.slot_mix))
    uidx = _draw_entities(rng, n, day_idx, spec, spec.n_users, spec.new_users_per_day, spec.user_zipf)
    iidx = _draw_entities(rng, n, day_idx, spec, spec.n_items, spec.new_items_per_day, spec.item_zipf)
    age, gender, occ, bias, fav1, fav2 = user_attrs(spec, uidx)
    adv, cat, quality = item_attrs(spec, iidx)
    hour = (t // 3_600_000_000).astype(np.int64)
    z = relevance(world, age, gender, occ, bias, fav1, fav2, cat, quality)
    logit = world.intercept[slot] + SLOT_SCALE[slot] * z + world.hour_effect[hour]
    label = rng.random(n) < sigmoid(logit)
    return {
        "t": t,
        "user": uidx,
        "item": iidx,
        "adv": adv,
        "slot": slot,
        "age": age,
        "gender": gender,
        "occ": occ,
        "cat": cat,
        "hour": hour,
        "label": label,
        "tone": np.digitize(quality, _TONE_EDGES),
    }


# The ad's text (item_title) says what the creative says: its tone follows the item's hidden quality,
# which drives clicks, so a family that reads text can score an ad on its first day.
_TONE_EDGES = np.array([-0.35, 0.35])
_TONES = ("basic", "popular", "premium")


def _ad_titles(tone: np.ndarray, cat: np.ndarray) -> pa.Array:
    words = pa.array([f"{t} {c.replace('_', ' ')} offer" for t in _TONES for c in CATEGORIES], pa.string())
    return pc.take(words, pa.array(tone * len(CATEGORIES) + cat))


def _ids(prefix: str, idx: np.ndarray) -> pa.Array:
    return pc.binary_join_element_wise(prefix, pc.cast(pa.array(idx), pa.string()), "")


def _labels(vocab: tuple[str, ...], codes: np.ndarray) -> pa.Array:
    return pc.take(pa.array(vocab, pa.string()), pa.array(codes))


def _frame(cols: dict, day_start_us: int, weekday: int) -> pd.DataFrame:
    strings = {
        "user_id": _ids("u", cols["user"]),
        "item_id": _ids("i", cols["item"]),
        "slot": _labels(SLOTS, cols["slot"]),
        "age_bucket": _labels(AGE_BUCKETS, cols["age"]),
        "gender": _labels(GENDERS, cols["gender"]),
        "occupation": _labels(OCCUPATIONS, cols["occ"]),
        "category": _labels(CATEGORIES, cols["cat"]),
        "advertiser_id": _ids("a", cols["adv"]),
        "item_title": _ad_titles(cols["tone"], cols["cat"]),
        "item_genres": _labels(CATEGORIES, cols["cat"]),
    }
    s = {
        k: pd.Series(v.to_pandas(types_mapper={pa.string(): pd.StringDtype()}.get), dtype="string")
        for k, v in strings.items()
    }
    ts = (cols["t"] + day_start_us).astype("datetime64[us]")
    n = len(ts)
    frame = pd.DataFrame(
        {
            "event_ts": pd.Series(ts).dt.tz_localize("UTC"),
            "user_id": s["user_id"],
            "item_id": s["item_id"],
            "slot": s["slot"],
            "label": cols["label"].astype(np.int8),
            "age_bucket": s["age_bucket"],
            "gender": s["gender"],
            "occupation": s["occupation"],
            "category": s["category"],
            "hour": cols["hour"].astype(np.int8),
            "weekday": np.full(n, weekday, dtype=np.int8),
            "advertiser_id": s["advertiser_id"],
            "item_title": s["item_title"],
            "item_genres": s["item_genres"],
        }
    )
    return schema.conform(frame, where="synthetic")


def generate_day(spec: SyntheticSpec, day: str, rows: int, chunk_rows: int = 500_000) -> Iterator[pd.DataFrame]:
    """The `rows` impressions of UTC day `day`, as an iterator of conformed frames of at most `chunk_rows` rows.

    Arguments are checked on the call (ConfigError); rows are generated lazily, one chunk at a time.

    Deterministic in (spec, day, rows): independent of other days and of chunk_rows. Rows are in
    event-time order across chunks.
    """
    _check(isinstance(spec, SyntheticSpec), f"spec must be a SyntheticSpec, got {type(spec).__name__}")
    _check(_is_int(rows) and rows >= 1, f"rows must be an integer >= 1, got {rows!r}")
    _check(_is_int(chunk_rows) and chunk_rows >= 1, f"chunk_rows must be an integer >= 1, got {chunk_rows!r}")
    day_idx = spec.day_index(day)
    return _generate_day(spec, _parse_day(day, "day"), day_idx, rows, chunk_rows)


def _generate_day(
    spec: SyntheticSpec, date: dt.date, day_idx: int, rows: int, chunk_rows: int
) -> Iterator[pd.DataFrame]:
    day_start_us = int(
        (
            dt.datetime(date.year, date.month, date.day, tzinfo=dt.timezone.utc)
            - dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
        )
        // dt.timedelta(microseconds=1)
    )
    world = calibrated_world(spec)
    pending: list[dict] = []  # blocks (or views of their tails) not yet emitted
    have = 0
    for b in range(-(-rows // _BLOCK)):
        pending.append(_block(spec, world, date.toordinal(), day_idx, b, rows))
        have += len(pending[-1]["t"])
        while have >= chunk_rows:
            yield _frame(_take(pending, chunk_rows), day_start_us, date.weekday())
            have -= chunk_rows
    if have:
        yield _frame(_take(pending, have), day_start_us, date.weekday())


def _take(pending: list[dict], k: int) -> dict:
    """Pop the first k rows off the pending blocks (views where a block is split)."""
    pieces = []
    while k:
        head = pending[0]
        m = len(head["t"])
        if m <= k:
            pieces.append(pending.pop(0))
            k -= m
        else:
            pieces.append({c: v[:k] for c, v in head.items()})
            pending[0] = {c: v[k:] for c, v in head.items()}
            k = 0
    if len(pieces) == 1:
        return pieces[0]
    return {c: np.concatenate([p[c] for p in pieces]) for c in pieces[0]}


def write_days(
    lake: Lake,
    spec: SyntheticSpec,
    start_day: str,
    days: int,
    rows_per_day: int,
    chunk_rows: int = 500_000,
    progress: bool = False,
    overwrite: bool = False,
) -> list[str]:
    """Generate `days` consecutive days from `start_day` into `lake`, one part file per chunk, each day
    committed on its own (`data.commit`): a day appears whole once its manifest is written, or not at all.

    A day already committed in the lake is replaced only with `overwrite=True`; without it the call
    raises PartitionExistsError naming every such day before writing anything. Replacing keeps the old
    parts until the new ones are committed. Returns the partition dates written, oldest first.
    """
    _check(_is_int(days) and days >= 1, f"days must be an integer >= 1, got {days!r}")
    _check(_is_int(rows_per_day) and rows_per_day >= 1, f"rows_per_day must be an integer >= 1, got {rows_per_day!r}")
    start = _parse_day(start_day, "start_day")
    dates = [(start + dt.timedelta(days=i)).isoformat() for i in range(days)]
    for d in dates:
        spec.day_index(d)  # fail before writing anything
    if not overwrite:
        commit.refuse_existing(lake, dates)
    bar = None
    if progress:
        bar = tqdm(total=days * rows_per_day, unit="rows", unit_scale=True, desc="synthetic")
    try:
        for d in dates:

            def on_part(chunk: pd.DataFrame, d: str = d) -> None:
                if bar is not None:
                    bar.update(len(chunk))
                    bar.set_postfix_str(f"dt={d}")

            commit.write_frames(
                lake, d, generate_day(spec, d, rows_per_day, chunk_rows), overwrite=overwrite, on_part=on_part
            )
    finally:
        if bar is not None:
            bar.close()
    return dates
