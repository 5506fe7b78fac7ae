"""The temporal split (no look-ahead, deterministic on ties) and the base model's window reader."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from pipelines.data.lake import Lake
from pipelines.data.splits import load_split, time_split
from pipelines.data.synthetic import SyntheticSpec, write_days
from pipelines.errors import PipelineError
from tests.conftest import validate_lake


def test_time_split_puts_the_newest_rows_in_holdout():
    rng = np.random.default_rng(0)
    n = 100
    ts = pd.date_range("2024-01-01", periods=n, freq="min", tz="UTC")
    frame = pd.DataFrame(
        {
            "event_ts": ts,
            "user_id": [f"u{i}" for i in range(n)],
            "item_id": [f"i{i}" for i in range(n)],
            "label": rng.integers(0, 2, n),
        }
    )
    shuffled = frame.sample(frac=1.0, random_state=1).reset_index(drop=True)
    tr, ho = time_split(shuffled, 0.2)
    assert (len(tr), len(ho)) == (80, 20)
    assert tr["event_ts"].max() < ho["event_ts"].min()
    assert set(ho["event_ts"]) == set(ts[-20:])
    assert tr["event_ts"].is_monotonic_increasing and ho["event_ts"].is_monotonic_increasing
    # nothing lost or duplicated
    assert sorted(pd.concat([tr, ho])["user_id"]) == sorted(frame["user_id"])
    # stable and independent of the input order
    tr2, ho2 = time_split(frame, 0.2)
    pd.testing.assert_frame_equal(ho, ho2)
    pd.testing.assert_frame_equal(tr, tr2)


def test_time_split_breaks_timestamp_ties_deterministically():
    ts = pd.Timestamp("2024-01-01", tz="UTC")
    frame = pd.DataFrame(
        {
            "event_ts": [ts] * 6,
            "user_id": ["u3", "u1", "u2", "u1", "u3", "u2"],
            "item_id": ["i1", "i2", "i1", "i1", "i0", "i0"],
            "label": [0, 1, 0, 1, 0, 1],
        }
    )
    tr, ho = time_split(frame, 0.34)
    tr2, ho2 = time_split(frame.iloc[::-1].reset_index(drop=True), 0.34)
    pd.testing.assert_frame_equal(ho, ho2)
    assert list(zip(ho["user_id"], ho["item_id"])) == [("u3", "i0"), ("u3", "i1")]


def test_load_split_reads_the_window_of_one_slot_and_refuses_too_few_rows(tmp_path):
    lake = Lake(str(tmp_path))
    write_days(lake, SyntheticSpec(n_users=500, n_items=100, n_advertisers=10, seed=3), "2024-01-02", 3, 600)
    validate_lake(str(tmp_path))  # the base model trains on validated days only
    split = load_split(str(tmp_path), "2024-01-04", 0.25, days=2, slot="feed")
    assert split.lineage["first"] == "2024-01-03" and split.lineage["count"] == 2  # the window, not the lake
    rows = len(split.train) + len(split.holdout)
    assert set(split.train["slot"]) == set(split.holdout["slot"]) == {"feed"}
    assert len(split.holdout) == rows - int(round(rows * 0.75))
    assert split.train["event_ts"].max() <= split.holdout["event_ts"].min()
    with pytest.raises(PipelineError, match="need at least"):
        load_split(str(tmp_path), "2024-01-04", 0.25, days=2, slot="feed", min_rows=10**6)
    with pytest.raises(PipelineError, match="no partitions"):
        load_split(str(tmp_path), "2023-01-04", 0.25)
