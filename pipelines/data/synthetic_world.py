"""The hidden world behind `pipelines.data.synthetic`: vocabularies, entity attributes and the click model.

Every entity's attributes are a hash of (seed, entity index), so they are the same on every day without
keeping any table in memory. `calibrated_world(spec)` draws the seed-level affinities and calibrates one
logit intercept per slot so each slot's realised CTR is close to `spec.slot_ctr`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from pipelines.data.synthetic import SyntheticSpec

SLOTS = ("feed", "search", "splash")
AGE_BUCKETS = ("<18", "18-24", "25-34", "35-44", "45-49", "50-55", "56+")
GENDERS = ("M", "F")
OCCUPATIONS = (
    "administrator",
    "artist",
    "doctor",
    "educator",
    "engineer",
    "entertainment",
    "executive",
    "healthcare",
    "homemaker",
    "lawyer",
    "librarian",
    "marketing",
    "none",
    "other",
    "programmer",
    "retired",
    "salesman",
    "scientist",
    "student",
    "technician",
    "writer",
)
CATEGORIES = (
    "retail",
    "fashion",
    "beauty",
    "travel",
    "finance",
    "insurance",
    "auto",
    "gaming",
    "apps",
    "food",
    "health",
    "education",
    "real_estate",
    "telecom",
    "entertainment",
    "sports",
)

_AGE_P = np.array([0.05, 0.20, 0.30, 0.20, 0.10, 0.08, 0.07])
_GENDER_P = np.array([0.52, 0.48])
_OCC_W = np.array([4, 2, 1, 5, 4, 1, 3, 2, 1, 1, 1, 2, 1, 5, 4, 1, 1, 2, 8, 2, 2], dtype=float)
_OCC_P = _OCC_W / _OCC_W.sum()
_STUDENT, _RETIRED = OCCUPATIONS.index("student"), OCCUPATIONS.index("retired")

SLOT_SCALE = np.array([1.0, 1.3, 0.6])  # relevance matters most in search, least on a splash screen
_FAV_BONUS = 0.8
_ADV_IN_VERTICAL = 0.85
_MASK64 = (1 << 64) - 1


# ---------------------------------------------------------------------------------- hashing
def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on a uint64 array (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _key(seed: int, tag: int) -> np.uint64:
    k = np.array(
        [(seed * 0x9E3779B97F4A7C15 + tag * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) & _MASK64], dtype=np.uint64
    )
    return _mix64(k)[0]


def _hash_uniform(seed: int, tag: int, idx: np.ndarray) -> np.ndarray:
    """A float64 in (0, 1) per index, a pure function of (seed, tag, index)."""
    h = _mix64(idx.astype(np.uint64) ^ _key(seed, tag))
    h = _mix64(h + np.uint64(0x9E3779B97F4A7C15))
    return ((h >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))


def _hash_normal(seed: int, tag: int, idx: np.ndarray) -> np.ndarray:
    u1 = _hash_uniform(seed, tag, idx)
    u2 = _hash_uniform(seed, tag + 0x5555, idx)
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


def categorical(u: np.ndarray, p: np.ndarray) -> np.ndarray:
    cdf = np.cumsum(p)
    return np.minimum(np.searchsorted(cdf / cdf[-1], u, side="right"), len(p) - 1)


def zipf_rank(u: np.ndarray, n: int, a: float) -> np.ndarray:
    """Rank in [0, n) with P(rank = k) roughly proportional to (k + 1) ** -a (inverse CDF of a power law)."""
    if abs(a - 1.0) < 1e-9:
        x = np.power(float(n + 1), u)
    else:
        b = 1.0 - a
        x = np.power(1.0 + u * ((n + 1.0) ** b - 1.0), 1.0 / b)
    return np.clip(np.floor(x).astype(np.int64) - 1, 0, n - 1)


# hash tags: one per entity attribute
_T_AGE, _T_GENDER, _T_OCC, _T_OCC_ADJ, _T_UBIAS, _T_FAV1, _T_FAV2 = 1, 2, 3, 4, 5, 6, 7
_T_ADV, _T_ICAT_KEEP, _T_ICAT, _T_IQUAL, _T_ACAT, _T_AQUAL = 11, 12, 13, 14, 15, 16


@dataclass(frozen=True)
class World:
    """Seed-level hidden parameters of the click model (shared by every day)."""

    aff_age: np.ndarray  # (ages, categories)
    aff_gender: np.ndarray  # (genders, categories)
    aff_occ: np.ndarray  # (occupations, categories)
    hour_effect: np.ndarray  # (24,)
    intercept: np.ndarray  # (slots,), calibrated to spec.slot_ctr


def user_attrs(spec: SyntheticSpec, uidx: np.ndarray):
    s = spec.seed
    age = categorical(_hash_uniform(s, _T_AGE, uidx), _AGE_P)
    gender = categorical(_hash_uniform(s, _T_GENDER, uidx), _GENDER_P)
    occ = categorical(_hash_uniform(s, _T_OCC, uidx), _OCC_P)
    adj = _hash_uniform(s, _T_OCC_ADJ, uidx)
    occ = np.where((age == 0) & (adj < 0.85), _STUDENT, occ)
    occ = np.where((age == len(AGE_BUCKETS) - 1) & (adj < 0.5), _RETIRED, occ)
    bias = 0.5 * _hash_normal(s, _T_UBIAS, uidx)
    ncat = len(CATEGORIES)
    fav1 = (_hash_uniform(s, _T_FAV1, uidx) * ncat).astype(np.int64)
    fav2 = (_hash_uniform(s, _T_FAV2, uidx) * ncat).astype(np.int64)
    return age, gender, occ, bias, fav1, fav2


def item_attrs(spec: SyntheticSpec, iidx: np.ndarray):
    s = spec.seed
    ncat = len(CATEGORIES)
    adv = zipf_rank(_hash_uniform(s, _T_ADV, iidx), spec.n_advertisers, 1.0)
    adv_cat = (_hash_uniform(s, _T_ACAT, adv) * ncat).astype(np.int64)
    own_cat = (_hash_uniform(s, _T_ICAT, iidx) * ncat).astype(np.int64)
    cat = np.where(_hash_uniform(s, _T_ICAT_KEEP, iidx) < _ADV_IN_VERTICAL, adv_cat, own_cat)
    quality = 0.4 * _hash_normal(s, _T_IQUAL, iidx) + 0.3 * _hash_normal(s, _T_AQUAL, adv)
    return adv, cat, quality


def relevance(world: World, age, gender, occ, bias, fav1, fav2, cat, quality) -> np.ndarray:
    """The slot-independent part of the click logit."""
    z = bias + quality + world.aff_age[age, cat] + world.aff_gender[gender, cat] + world.aff_occ[occ, cat]
    return z + _FAV_BONUS * ((cat == fav1).astype(np.float64) + (cat == fav2).astype(np.float64))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


@functools.lru_cache(maxsize=8)
def calibrated_world(spec: SyntheticSpec) -> World:
    rng = np.random.default_rng(np.random.SeedSequence(spec.seed, spawn_key=(0,)))
    na, ng, no, nc = len(AGE_BUCKETS), len(GENDERS), len(OCCUPATIONS), len(CATEGORIES)
    hours = np.arange(24)
    world = World(
        aff_age=rng.normal(0.0, 0.35, (na, nc)),
        aff_gender=rng.normal(0.0, 0.25, (ng, nc)),
        aff_occ=rng.normal(0.0, 0.3, (no, nc)),
        hour_effect=0.25 * np.cos(2 * np.pi * (hours - 20) / 24),  # evening peak (20h UTC), morning trough
        intercept=np.zeros(len(SLOTS)),
    )
    # Calibrate slot intercepts on a day-0 traffic sample so each slot's mean CTR hits spec.slot_ctr.
    m = 50_000
    uidx = zipf_rank(rng.random(m), spec.n_users, spec.user_zipf)
    iidx = zipf_rank(rng.random(m), spec.n_items, spec.item_zipf)
    age, gender, occ, bias, fav1, fav2 = user_attrs(spec, uidx)
    _, cat, quality = item_attrs(spec, iidx)
    z = relevance(world, age, gender, occ, bias, fav1, fav2, cat, quality)
    hour_eff = world.hour_effect[rng.integers(0, 24, m)]
    for s, target in enumerate(spec.slot_ctr):
        x = SLOT_SCALE[s] * z + hour_eff
        lo, hi = -20.0, 10.0
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if sigmoid(mid + x).mean() < target else (lo, mid)
        world.intercept[s] = 0.5 * (lo + hi)
    world.intercept.flags.writeable = False
    return world
