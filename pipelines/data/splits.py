"""Training data from the lake in memory: the window of partitions, the slot filter, the temporal split.

The base model reads its window this way (`load_split`); adapters stream theirs (`model.stream`),
split by the same rule: the newest rows hold out. Either way only committed partitions validated as
they are now are read (`data.validated`).
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from pipelines.data.lake import Lake, concat, lineage
from pipelines.data.validated import read_validated_window
from pipelines.errors import PipelineError


@dataclass
class Split:
    train: pd.DataFrame
    holdout: pd.DataFrame
    lineage: dict


def time_split(frame: pd.DataFrame, holdout_fraction: float) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Oldest rows train, newest `holdout_fraction` hold out (no look-ahead); stable on ties."""
    frame = frame.sort_values(["event_ts", "user_id", "item_id"], kind="stable").reset_index(drop=True)
    cut = int(round(len(frame) * (1.0 - holdout_fraction)))
    return frame.iloc[:cut].reset_index(drop=True), frame.iloc[cut:].reset_index(drop=True)


def load_split(
    lake_uri: str,
    end_day: str,
    holdout_fraction: float,
    *,
    days: int | None = None,
    start_day: str | None = None,
    slot: str | None = None,
    min_rows: int = 1,
) -> Split:
    parts = read_validated_window(Lake(lake_uri), end_day, days or 1, start_day=start_day)
    if not parts:
        raise PipelineError(f"no partitions in {lake_uri} for the window ending {end_day}")
    frame = concat(parts)
    if slot is not None:
        frame = frame[frame["slot"] == slot]
    if len(frame) < min_rows:
        raise PipelineError(
            f"only {len(frame)} rows for slot={slot!r} in the window ending {end_day} "
            f"({len(parts)} partitions); need at least {min_rows}"
        )
    train, holdout = time_split(frame, holdout_fraction)
    return Split(train, holdout, lineage(parts))
