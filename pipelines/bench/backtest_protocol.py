"""The daily test-then-train protocol of `python -m pipelines backtest` (issue 14).

The event log (MovieLens-100K, sorted by event time) is cut where the retired static benchmark cut it
(`temporal_split`, the earliest `TRAIN_FRACTION` of the rows) unless `--from` names
a day. Every day from there is a *scored day*: its rows are scored by models fitted only on the rows
before the day's first scored row (its *history*), and only then may anything train on them. With
the default cut the first day's earliest rows (47 of 1998-03-07) fall before the cut: they are history,
and that day scores the rest, so the 20,000 scored rows are exactly the static benchmark's test part.

A scored row is *warm* when its user has a row in the day's history (seen before the day), *cold*
otherwise; `summary` reports AUC over all scored rows, the warm ones and the cold ones. A scored row is
of a *new item* when its item has no row before the first scored day (first seen in the test period: where a
family that reads the item's text should beat one that learns an id's row); `summary` reports those too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from pipelines.errors import ConfigError
from pipelines.metrics import auc

EXPERIMENT = "ctr-backtest"  # the MLflow experiment of backtest runs and comparisons (--mlflow)
# Where the default first scored day falls: after the earliest 80% of the rows, so that the scored rows are
# exactly the test part of the static benchmark the backtest replaced (docs/history.md).
TRAIN_FRACTION = 0.8
# The latest share of a history that choices made before the first scored day are validated on (the LR's C).
VAL_FRACTION = 0.1


def temporal_split(frame: pd.DataFrame, fraction: float) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(earliest `fraction` of the rows by event time, the rest); stable for equal timestamps."""
    f = frame.sort_values("event_ts", kind="stable").reset_index(drop=True)
    cut = int(round(fraction * len(f)))
    return f.iloc[:cut].reset_index(drop=True), f.iloc[cut:].reset_index(drop=True)


@dataclass(frozen=True)
class Day:
    """One scored day: its rows are `frame.iloc[start:stop]`; its history is `frame.iloc[:start]`."""

    date: str
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Backtest:
    """The event log and its scored days; `warm[i]` is True when row `i` (a scored row) is warm."""

    frame: pd.DataFrame
    days: tuple[Day, ...]
    warm: np.ndarray
    dates: np.ndarray  # "YYYY-MM-DD" (UTC) of every row of `frame`
    new_item: np.ndarray | None = None  # True for a scored row whose item has no row before the first day

    @property
    def first(self) -> int:
        return self.days[0].start

    @property
    def last(self) -> int:
        return self.days[-1].stop

    def history(self, day: Day) -> pd.DataFrame:
        return self.frame.iloc[: day.start]

    def scored(self, day: Day) -> pd.DataFrame:
        return self.frame.iloc[day.start : day.stop]

    def window(self, day: Day, days: int) -> pd.DataFrame:
        """The history rows of the `days` calendar days before `day` (the trailing window an adapter
        trained that morning would read)."""
        first = (pd.Timestamp(day.date) - pd.Timedelta(days=days)).strftime("%Y-%m-%d")
        lo = int(np.searchsorted(self.dates[: day.start], first, side="left"))
        return self.frame.iloc[lo : day.start]

    def slot_days(self) -> np.ndarray:
        """ "<day>/<slot>" of every scored row: the groups one adapter scores (`auc_within`)."""
        scored = slice(self.first, self.last)
        return np.char.add(
            np.char.add(self.dates[scored].astype(str), "/"),
            self.frame["slot"].iloc[scored].astype(str).to_numpy().astype(str),
        )

    def labels(self) -> np.ndarray:
        return self.frame["label"].to_numpy()[self.first : self.last].astype(np.int64)


def build(
    frame: pd.DataFrame, day_from: str | None = None, day_to: str | None = None, max_days: int | None = None
) -> Backtest:
    """The scored days of `frame` from `day_from` (default: the static benchmark's cut) through
    `day_to` (default: the last day), at most `max_days` of them. A range with no rows, or none
    before it to train on, is a ConfigError."""
    f = frame.sort_values("event_ts", kind="stable").reset_index(drop=True)
    dates = f["event_ts"].dt.strftime("%Y-%m-%d").to_numpy()
    if day_from is None:
        start = int(round(TRAIN_FRACTION * len(f)))
    else:
        start = int(np.searchsorted(dates, _day(day_from, "--from"), side="left"))
    stop = len(f) if day_to is None else int(np.searchsorted(dates, _day(day_to, "--to"), side="right"))
    if start == 0:
        raise ConfigError(f"backtest: no rows before {day_from} to train on (the log starts {dates[0]})")
    if stop <= start:
        raise ConfigError(f"backtest: no rows from {day_from or dates[min(start, len(f) - 1)]} to {day_to}")
    days = []
    i = start
    while i < stop and (max_days is None or len(days) < max_days):
        j = min(int(np.searchsorted(dates, dates[i], side="right")), stop)
        days.append(Day(str(dates[i]), i, j))
        i = j
    warm = np.zeros(len(f), dtype=bool)
    users = f["user_id"].to_numpy()
    seen = set(users[:start])
    for d in days:
        day_users = users[d.start : d.stop]
        warm[d.start : d.stop] = [u in seen for u in day_users]
        seen.update(day_users)
    # pandas hashes; np.isin on object ids (strings) compares every pair: minutes on MovieLens
    new_item = ~f["item_id"].isin(set(f["item_id"].iloc[:start])).to_numpy()
    new_item[:start] = False
    return Backtest(f, tuple(days), warm, dates, new_item)


def _day(value: str, flag: str) -> str:
    try:
        return pd.Timestamp(value).strftime("%Y-%m-%d")
    except (ValueError, TypeError) as e:
        raise ConfigError(f"backtest {flag}: {value!r} is not a day (YYYY-MM-DD)") from e


def summary(y: np.ndarray, p: np.ndarray, warm: np.ndarray, new_item: np.ndarray | None = None) -> dict:
    """AUC over all rows, the warm rows and the cold rows, and with `new_item` the rows of new items (None
    where a part has one class or no rows)."""

    def clean(mask: np.ndarray):
        if mask.sum() == 0 or len(set(y[mask])) < 2:
            return None
        v = auc(y[mask], p[mask])
        return None if math.isnan(v) else round(float(v), 4)

    every = np.ones(len(y), dtype=bool)
    out = {"auc": clean(every), "auc_warm": clean(warm), "auc_cold": clean(~warm)}
    if new_item is not None:
        out["auc_new_item"] = clean(new_item)
    return out


def auc_within(y: np.ndarray, p: np.ndarray, groups: np.ndarray) -> float | None:
    """The mean AUC inside each group, weighted by its rows (groups with one class are left out). Pooled AUC
    also rewards a model whose score *level* follows each group's click rate; this one sees the ranking inside
    a group alone, so the two apart tell a model that ranks worse from one whose level drifts (a daily adapter
    per slot that learned its window's click rate scores the next day's rows at that rate)."""
    total, weight = 0.0, 0
    for g in np.unique(groups):
        m = groups == g
        if len(set(y[m])) < 2:
            continue
        v = auc(y[m], p[m])
        if not math.isnan(v):
            total, weight = total + v * int(m.sum()), weight + int(m.sum())
    return round(total / weight, 4) if weight else None
