"""Cold-start detection and the entity-level split (pipelines.data.cold) on constructed frames."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from pipelines.data import cold as CE

CUTOFF = "2024-01-10"


def rows(spec: list[tuple[str, str, str]], slot: str = "feed") -> pd.DataFrame:
    """(timestamp, user, item) triples -> a frame with the columns detection and split read."""
    ts = pd.to_datetime([t for t, _, _ in spec], utc=True)
    return pd.DataFrame(
        {
            "event_ts": ts,
            "user_id": pd.array([u for _, u, _ in spec], dtype="string"),
            "item_id": pd.array([i for _, _, i in spec], dtype="string"),
            "slot": slot,
            "label": np.arange(len(spec)) % 2,
        }
    )


# ----------------------------------------------------------------------------- detection
@pytest.fixture
def history_window():
    history = rows(
        [("2024-01-05 10:00", "old", "i_old")] * 10  # warm user, warm item
        + [("2024-01-05 11:00", "sparse", "i_old")] * 2  # seen by the base, but only twice
        + [("2024-01-10 23:59", "edge", "i_old")] * 5  # on the cutoff day: seen by the base
        + [("2024-01-15 09:00", "late", "i_old")] * 5  # first seen after the cutoff, before the window
        + [("2024-01-05 12:00", "gone", "i_sparse")]  # not in the window: never reported
        + [("2024-01-16 12:00", "old", "i_late")] * 4
    )  # item first seen after the cutoff
    window = rows(
        [
            ("2024-01-20 10:00", "old", "i_old"),
            ("2024-01-20 11:00", "old", "i_new"),
            ("2024-01-20 12:00", "sparse", "i_old"),
            ("2024-01-21 10:00", "late", "i_old"),
            ("2024-01-21 11:00", "edge", "i_old"),
            ("2024-01-22 10:00", "fresh", "i_sparse"),
            ("2024-01-22 11:00", "old", "i_late"),
        ]
    )
    return history, window


def test_detect_finds_new_and_sparse_users_and_items(history_window):
    history, window = history_window
    cold = CE.detect(history, window, CUTOFF, min_impressions=3)
    assert cold.new_users == {"late", "fresh"}
    assert cold.sparse_users == {"sparse", "fresh"}  # fresh: 0 impressions before the window
    assert cold.users == {"late", "fresh", "sparse"}  # old and edge are warm; gone is not in the window
    assert cold.new_items == {"i_new", "i_late"}
    assert cold.sparse_items == {"i_new", "i_sparse"}
    assert cold.counts() == {
        "new_users": 2,
        "sparse_users": 1,
        "cold_users": 3,
        "new_items": 2,
        "sparse_items": 1,
        "cold_items": 3,
    }
    mask = CE.cold_mask(window, cold)
    assert mask.tolist() == [False, True, True, True, False, True, True]


def test_detect_thresholds_and_items_switch(history_window):
    history, window = history_window
    assert CE.detect(history, window, CUTOFF, min_impressions=0).sparse_users == frozenset()
    assert "late" not in CE.detect(history, window, CUTOFF, min_impressions=5).sparse_users  # 5 impressions
    assert "late" in CE.detect(history, window, CUTOFF, min_impressions=6).sparse_users
    # a later cutoff: the base saw `late` too
    assert CE.detect(history, window, "2024-01-15", min_impressions=0).new_users == {"fresh"}
    no_items = CE.detect(history, window, CUTOFF, min_impressions=3, items=False)
    assert no_items.items == frozenset() and no_items.users == {"late", "fresh", "sparse"}
    # no history at all: everyone in the window is new (and sparse)
    assert CE.detect(history.iloc[:0], window, CUTOFF, 1).new_users == set(window["user_id"])


# ----------------------------------------------------------------------------- split
def split_window() -> tuple[pd.DataFrame, CE.ColdEntities]:
    spec = (
        [("2024-01-20 10:00", "warm", "i1"), ("2024-01-20 10:30", "warm", "i_cold")]
        + [(f"2024-01-21 0{h}:00", "c1", f"i{h}") for h in range(5)]  # first cold user, 5 rows
        + [(f"2024-01-22 0{h}:00", "c2", f"i{h}") for h in range(3)]  # second
        + [("2024-01-23 01:00", "warm", "i_cold"), ("2024-01-23 02:00", "warm", "i_cold")]
        + [(f"2024-01-24 0{h}:00", "c3", f"i{h}") for h in range(4)]  # newest: held out
        + [("2024-01-24 09:00", "c1", "i9"), ("2024-01-25 01:00", "warm", "i1")]
    )  # after the holdout start
    frame = rows(spec).sample(frac=1.0, random_state=0)  # order must not matter
    cold = CE.ColdEntities(
        new_users=frozenset({"c1", "c2", "c3"}),
        sparse_users=frozenset(),
        new_items=frozenset({"i_cold"}),
        sparse_items=frozenset(),
    )
    return frame, cold


def test_split_holds_out_the_newest_cold_users_and_trains_only_before_them():
    frame, cold = split_window()
    sp = CE.split(frame, cold, holdout_fraction=0.34, labelled_per_entity=0)
    assert sp.holdout_users == 1 and set(sp.holdout["user_id"]) == {"c3"} and len(sp.holdout) == 4
    start = pd.Timestamp(sp.holdout_start)
    assert start == pd.Timestamp("2024-01-24 00:00", tz="UTC")
    for part in (sp.labelled, sp.transfer):
        assert (part["event_ts"] < start).all() and "c3" not in set(part["user_id"])
    # every cold row before the holdout: c1 (5), c2 (3), and the cold item's three rows of a warm user
    assert len(sp.labelled) == 11 and sp.labelled["event_ts"].is_monotonic_increasing
    assert sp.transfer.equals(sp.labelled)  # transfer="cold": the same rows, labels unused
    assert "2024-01-24 09:00" not in set(sp.labelled["event_ts"].dt.strftime("%Y-%m-%d %H:%M"))


def test_split_caps_labels_per_entity_and_can_transfer_the_whole_window():
    frame, cold = split_window()
    sp = CE.split(frame, cold, 0.34, labelled_per_entity=2, transfer="window")
    counts = sp.labelled.groupby(sp.labelled["user_id"].astype(str)).size().to_dict()
    assert counts == {"c1": 2, "c2": 2, "warm": 2}  # warm's rows: the cold item's first two
    first_c1 = sp.labelled[sp.labelled["user_id"] == "c1"]["item_id"].tolist()
    assert first_c1 == ["i0", "i1"]  # the earliest rows, not any two
    assert len(sp.transfer) == 12 and "warm" in set(sp.transfer["user_id"])  # every row before the holdout


def test_split_refuses_what_it_cannot_split():
    frame, cold = split_window()
    with pytest.raises(ValueError, match="no cold users"):
        CE.split(frame, CE.ColdEntities(frozenset(), frozenset(), frozenset(), frozenset()), 0.2, 0)
    with pytest.raises(ValueError, match="cannot hold out"):
        CE.split(frame[frame["user_id"] == "c1"], cold, 0.5, 0)
    with pytest.raises(ValueError, match="transfer"):
        CE.split(frame, cold, 0.34, 0, transfer="everything")


def test_cap_transfer_keeps_the_newest_rows():
    frame = rows([(f"2024-01-2{d} 00:00", f"u{d}", "i") for d in range(5)])
    assert CE.cap_transfer(frame, 10) is frame
    assert CE.cap_transfer(frame, 2)["user_id"].tolist() == ["u3", "u4"]
