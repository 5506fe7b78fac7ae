"""The faults `backtest --faults` injects into a day of the `served` replay (issue 31).

Each is a pure function of the day's rows (and the day before's, for a replay) that keeps the contract:
the columns, their types and domains, and every event time inside the day all stay valid, so the fault
tests judgement (validation's consistency checks, the gate), not the schema. `inject` names them.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from pipelines.errors import ConfigError

SEED = 31


def flip_labels(day: pd.DataFrame, previous: pd.DataFrame) -> pd.DataFrame:
    """Every label flipped: clicks become non-clicks and back."""
    return day.assign(label=(1 - day["label"]).astype(day["label"].dtype))


def shuffle_items(day: pd.DataFrame, previous: pd.DataFrame) -> pd.DataFrame:
    """The item ids permuted across the day's rows; every other column (the item's category too) stays."""
    rng = np.random.default_rng(SEED)
    shuffled = day["item_id"].to_numpy()[rng.permutation(len(day))]
    return day.assign(item_id=pd.Series(shuffled, index=day.index, dtype=day["item_id"].dtype))


def constant_feature(day: pd.DataFrame, previous: pd.DataFrame) -> pd.DataFrame:
    """`category` stuck at the day's most frequent value (a broken join that defaults a feature)."""
    return day.assign(category=pd.Series(day["category"].mode().iloc[0], index=day.index, dtype=day["category"].dtype))


def restamped_yesterday(day: pd.DataFrame, previous: pd.DataFrame) -> pd.DataFrame:
    """The day before's rows again, their event times moved onto this day (time of day kept), weekday
    recomputed: an export job that re-sent yesterday's file under today's date."""
    if previous.empty:
        raise ConfigError("fault restamped_yesterday: there is no day before to re-send")
    ts = pd.to_datetime(previous["event_ts"], utc=True)
    target = pd.Timestamp(pd.to_datetime(day["event_ts"], utc=True).dt.floor("D").iloc[0])
    moved = target + (ts - ts.dt.floor("D"))
    return previous.assign(event_ts=moved, weekday=moved.dt.weekday.astype(previous["weekday"].dtype))


def label_leak(day: pd.DataFrame, previous: pd.DataFrame) -> pd.DataFrame:
    """The label leaked into `hour`: clicks at 12-23, the others at 0-11 (hour's domain kept)."""
    hour = day["hour"].astype("int64") % 12 + 12 * day["label"].astype("int64")
    return day.assign(hour=hour.astype(day["hour"].dtype))


def single_slot(day: pd.DataFrame, previous: pd.DataFrame) -> pd.DataFrame:
    """Only the rows of the day's largest slot: the others' logging broke."""
    return day[day["slot"] == day["slot"].value_counts().idxmax()]


FAULTS = {
    f.__name__: f for f in (flip_labels, shuffle_items, constant_feature, restamped_yesterday, label_leak, single_slot)
}


def inject(name: str, day: pd.DataFrame, previous: pd.DataFrame) -> pd.DataFrame:
    """`day`'s rows with the fault `name`; `previous`: the rows of the day before (restamped_yesterday)."""
    if name not in FAULTS:
        raise ConfigError(f"unknown fault {name!r}; choose from {sorted(FAULTS)}")
    return FAULTS[name](day, previous).reset_index(drop=True)
