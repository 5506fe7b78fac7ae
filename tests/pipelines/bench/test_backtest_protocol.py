"""The backtest's day-by-day protocol on a small hand-made log: scored days, history, windows, warm rows."""

import numpy as np
import pandas as pd
import pytest

from pipelines.bench.backtest_protocol import auc_within, build, summary, temporal_split
from pipelines.errors import ConfigError


def _log() -> pd.DataFrame:
    """10 rows over 5 days (2 a day), users a..e; c first appears on day 3, e on day 5."""
    days = [
        "2024-01-01",
        "2024-01-01",
        "2024-01-02",
        "2024-01-02",
        "2024-01-03",
        "2024-01-03",
        "2024-01-04",
        "2024-01-04",
        "2024-01-05",
        "2024-01-05",
    ]
    users = ["a", "b", "a", "b", "c", "a", "c", "d", "e", "a"]
    items = ["x", "y", "x", "y", "z", "x", "z", "w", "v", "x"]  # v is first seen on day 5
    ts = pd.to_datetime([f"{d} {10 + i % 2}:00" for i, d in enumerate(days)], utc=True)
    frame = pd.DataFrame({"event_ts": ts, "user_id": users, "item_id": items, "slot": "morning", "label": [0, 1] * 5})
    return frame.sample(frac=1.0, random_state=0)  # build sorts by event time itself


def test_the_default_cut_is_the_static_benchmarks_and_splits_a_day():
    bt = build(_log())
    # the earliest 80% (8 rows) are history: day 5's two rows are the only scored ones
    assert [(d.date, d.start, d.stop) for d in bt.days] == [("2024-01-05", 8, 10)]
    assert len(bt.history(bt.days[0])) == 8
    assert bt.new_item.tolist() == [False] * 8 + [True, False]  # v is new; x was seen before the first day

    frame = _log()
    frame = pd.concat([frame, frame.iloc[:1].assign(event_ts=pd.Timestamp("2024-01-05 09:00", tz="UTC"))])
    bt = build(frame)  # 11 rows: the cut (row 9) falls inside 2024-01-05, whose first row stays history
    assert [(d.date, d.start, d.stop) for d in bt.days] == [("2024-01-05", 9, 11)]
    assert bt.history(bt.days[0])["event_ts"].max() == pd.Timestamp("2024-01-05 09:00", tz="UTC")


def test_temporal_split_cuts_at_the_fraction_by_event_time_not_by_row_order():
    ts = pd.to_datetime([3, 1, 2, 5, 4], unit="s", utc=True)
    f = pd.DataFrame({"event_ts": ts, "user_id": ["a", "b", "a", "c", "b"]})
    tr, te = temporal_split(f, 0.6)
    assert list(tr["event_ts"]) == sorted(ts)[:3] and list(te["event_ts"]) == sorted(ts)[3:]


def test_days_history_window_and_warm_rows():
    bt = build(_log(), "2024-01-02", "2024-01-04")
    assert [d.date for d in bt.days] == ["2024-01-02", "2024-01-03", "2024-01-04"]
    d3 = bt.days[1]
    assert list(bt.history(d3)["user_id"]) == ["a", "b", "a", "b"]  # nothing of the day itself
    assert list(bt.scored(d3)["user_id"]) == ["c", "a"]
    assert list(bt.window(d3, 1)["user_id"]) == ["a", "b"]  # only 2024-01-02
    assert len(bt.window(d3, 30)) == 4
    # warm = the user has a row before the day: c is cold on day 3, warm on day 4; d is cold
    assert bt.warm[bt.first : bt.last].tolist() == [True, True, False, True, True, False]
    assert bt.labels().tolist() == [0, 1, 0, 1, 0, 1]
    assert len(build(_log(), "2024-01-02", max_days=2).days) == 2


@pytest.mark.parametrize(
    "day_from, day_to, match",
    [
        ("2024-01-01", None, "no rows before"),
        ("2024-02-01", None, "no rows from"),
        ("2024-01-03", "2024-01-02", "no rows from"),
        ("tuesday", None, "--from: 'tuesday' is not a day"),
    ],
)
def test_a_range_without_rows_or_history_is_refused(day_from, day_to, match):
    with pytest.raises(ConfigError, match=match):
        build(_log(), day_from, day_to)


def test_summary_splits_warm_and_cold_and_says_none_where_undefined():
    y = np.array([0, 1, 0, 1, 1])
    p = np.array([0.1, 0.9, 0.5, 0.2, 0.7])
    warm = np.array([True, True, False, False, False])
    s = summary(y, p, warm)
    assert s["auc_warm"] == 1.0 and s["auc_cold"] == 0.5
    assert s["auc"] == pytest.approx(5 / 6, abs=1e-4)
    assert summary(y, p, np.ones(5, dtype=bool))["auc_cold"] is None
    new_item = np.array([False, True, True, False, True])
    assert summary(y, p, warm, new_item)["auc_new_item"] == 1.0  # rows 1, 2, 4: 0.9 and 0.7 above 0.5
    assert "auc_new_item" not in summary(y, p, warm)


def test_auc_within_groups_sees_ranking_not_the_level_of_each_group():
    """Two groups each ranked perfectly: within-group AUC 1 whatever each group's level; pooled AUC drops
    when one group's scores sit above the other's though its rows click less."""
    y = np.array([0, 1, 0, 1, 0, 0, 1])
    groups = np.array(["d1/a"] * 2 + ["d1/b"] * 4 + ["d2/a"])  # the last group has one class: left out
    level = np.array([0.1, 0.2, 0.8, 0.9, 0.7, 0.75, 0.5])  # group b sits higher, and clicks less
    assert auc_within(y, level, groups) == 1.0
    assert summary(y, level, np.ones(7, dtype=bool))["auc"] < 0.8
    worse = np.array([0.2, 0.1, 0.8, 0.9, 0.7, 0.75, 0.5])  # group a ranked backwards: weight 2 of 6
    assert auc_within(y, worse, groups) == pytest.approx(4 / 6, abs=1e-4)
    assert auc_within(y[:1], level[:1], groups[:1]) is None


def test_slot_days_name_each_scored_rows_day_and_slot():
    bt = build(_log(), "2024-01-04")
    assert list(bt.slot_days()) == ["2024-01-04/morning"] * 2 + ["2024-01-05/morning"] * 2
