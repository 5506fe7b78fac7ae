"""Synthetic ad logs: contract, determinism, chunking, cold start, click model, spec validation."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pandas as pd
import pytest
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.preprocessing import OneHotEncoder

from pipelines.data import schema, synthetic
from pipelines.data.commit import PartitionExistsError
from pipelines.data.lake import Lake
from pipelines.data.synthetic import SLOTS, SyntheticSpec, generate_day, write_days
from pipelines.errors import ConfigError

SMALL = SyntheticSpec(
    n_users=5_000,
    n_items=500,
    n_advertisers=50,
    new_users_per_day=300,
    new_items_per_day=30,
    new_entity_rate=0.1,
    seed=7,
)
D0 = SMALL.origin_day  # day 0: no cold-start ids yet


def day(spec: SyntheticSpec, d: str, rows: int, chunk_rows: int = 500_000) -> pd.DataFrame:
    return pd.concat(list(generate_day(spec, d, rows, chunk_rows)), ignore_index=True)


def num(ids: pd.Series) -> np.ndarray:
    return ids.str[1:].astype("int64").to_numpy()


@pytest.fixture(scope="module")
def big_day() -> pd.DataFrame:
    """Default spec, 300k rows of day 3: enough for CTR statistics."""
    return day(SyntheticSpec(seed=3), "2024-01-04", 300_000)


# ---------------------------------------------------------------------------- contract
def test_rows_follow_the_contract():
    df = day(SMALL, "2024-01-03", 5_000)
    assert tuple(df.columns) == schema.ALL_NAMES  # every contract column, advertiser_id included
    pd.testing.assert_frame_equal(schema.conform(df), df)  # already conformed
    assert schema.to_arrow(df).schema.equals(schema.arrow_schema(include_optional=True))
    assert not df.isna().any().any()
    assert set(df["slot"].unique()) == set(SLOTS)
    assert set(df["label"].unique()) <= {0, 1}
    assert set(df["age_bucket"].unique()) <= set(synthetic.AGE_BUCKETS)
    assert set(df["gender"].unique()) == set(synthetic.GENDERS)
    assert set(df["occupation"].unique()) <= set(synthetic.OCCUPATIONS)
    assert set(df["category"].unique()) <= set(synthetic.CATEGORIES)
    assert df["user_id"].str.match(r"^u\d+$").all() and df["item_id"].str.match(r"^i\d+$").all()
    assert df["advertiser_id"].str.match(r"^a\d+$").all()
    assert (num(df["advertiser_id"]) < SMALL.n_advertisers).all()


def test_event_time_uniform_within_the_utc_day_and_sorted():
    df = day(SMALL, "2024-01-03", 48_000, chunk_rows=7_000)
    start = pd.Timestamp("2024-01-03", tz="UTC")
    assert df["event_ts"].min() >= start and df["event_ts"].max() < start + pd.Timedelta(days=1)
    assert df["event_ts"].is_monotonic_increasing
    assert (df["hour"] == df["event_ts"].dt.hour).all()
    assert (df["weekday"] == df["event_ts"].dt.day_of_week).all() and (df["weekday"] == 2).all()  # a Wednesday
    per_hour = df["hour"].value_counts()
    assert len(per_hour) == 24 and per_hour.between(1_700, 2_300).all()  # 2,000 expected per hour


def test_entities_have_stable_attributes_across_days():
    a = day(SMALL, "2024-01-02", 20_000)
    b = day(SMALL, "2024-01-09", 20_000)
    both = pd.concat([a, b])
    for key, attrs in (("user_id", ["age_bucket", "gender", "occupation"]), ("item_id", ["advertiser_id", "category"])):
        assert (both.groupby(key)[attrs].nunique() == 1).all().all(), key
    # advertisers own items mostly within their vertical
    top = both.groupby("advertiser_id")["category"].agg(lambda s: s.value_counts(normalize=True).iloc[0])
    assert top.mean() > 0.7


# ---------------------------------------------------------------------------- determinism
def test_same_seed_same_day_is_identical():
    pd.testing.assert_frame_equal(day(SMALL, "2024-01-05", 3_000), day(SMALL, "2024-01-05", 3_000))


def test_different_seed_or_day_differs():
    a = day(SMALL, "2024-01-05", 3_000)
    b = day(dataclasses.replace(SMALL, seed=8), "2024-01-05", 3_000)
    c = day(SMALL, "2024-01-06", 3_000)
    for other in (b, c):
        assert not a["user_id"].equals(other["user_id"])
        assert not a["event_ts"].dt.time.equals(other["event_ts"].dt.time)


def test_day_is_independent_of_other_days_and_of_chunking(tmp_path):
    alone = day(SMALL, "2024-01-06", 70_000)
    lake = Lake(str(tmp_path))
    assert write_days(lake, SMALL, "2024-01-04", 3, 70_000, chunk_rows=30_000) == [
        "2024-01-04",
        "2024-01-05",
        "2024-01-06",
    ]
    pd.testing.assert_frame_equal(lake.read_partition("2024-01-06").frame, alone)
    for chunk_rows in (1_000, 65_536, 69_999, 10**6):
        pd.testing.assert_frame_equal(day(SMALL, "2024-01-06", 70_000, chunk_rows), alone)


def test_spec_lists_are_tuples_and_specs_hash():
    spec = SyntheticSpec(slot_mix=[0.5, 0.3, 0.2], slot_ctr=[0.03, 0.06, 0.01])
    assert spec.slot_mix == (0.5, 0.3, 0.2) and isinstance(spec.slot_ctr, tuple)
    assert hash(spec) == hash(SyntheticSpec(slot_mix=(0.5, 0.3, 0.2), slot_ctr=(0.03, 0.06, 0.01)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.seed = 3


# ---------------------------------------------------------------------------- chunking
@pytest.mark.parametrize("rows,chunk_rows", [(1, 10), (10, 10), (25_000, 10_000), (70_000, 65_536), (5, 1)])
def test_chunks_cover_rows_and_respect_chunk_rows(rows, chunk_rows):
    chunks = list(generate_day(SMALL, "2024-01-02", rows, chunk_rows))
    assert sum(len(c) for c in chunks) == rows
    assert all(0 < len(c) <= chunk_rows for c in chunks)
    assert len(chunks) == math.ceil(rows / chunk_rows)
    assert all(list(c.index) == list(range(len(c))) for c in chunks)


def test_generate_day_is_lazy():
    gen = generate_day(SMALL, "2024-01-02", 10**9, chunk_rows=100)  # would never fit in memory
    assert len(next(gen)) == 100
    gen.close()


def test_write_days_one_part_per_chunk(tmp_path):
    lake = Lake(str(tmp_path / "clicks"))
    assert write_days(lake, SMALL, "2024-01-01", 2, 25_000, chunk_rows=10_000) == ["2024-01-01", "2024-01-02"]
    assert lake.list_partitions() == ["2024-01-01", "2024-01-02"]
    got = lake.read_partition("2024-01-02")
    assert [f.rsplit("/", 1)[-1] for f in got.files] == [f"part-{i:05d}-{got.generation}.parquet" for i in range(3)]
    pd.testing.assert_frame_equal(got.frame, day(SMALL, "2024-01-02", 25_000))


def test_write_days_rerun_replaces_the_partition_only_with_overwrite(tmp_path):
    lake = Lake(str(tmp_path))
    write_days(lake, SMALL, "2024-01-02", 1, 25_000, chunk_rows=5_000)  # 5 parts
    first = lake.read_partition("2024-01-02")
    before = {f: open(f, "rb").read() for f in lake.objects("2024-01-02")}
    with pytest.raises(PartitionExistsError, match=r"dt=2024-01-02: refusing") as info:
        write_days(lake, SMALL, "2024-01-01", 3, 25_000)  # refused before writing anything
    assert info.value.days == ["2024-01-02"] and lake.list_partitions() == ["2024-01-02"]
    assert {f: open(f, "rb").read() for f in lake.objects("2024-01-02")} == before
    write_days(lake, SMALL, "2024-01-02", 1, 25_000, chunk_rows=20_000, overwrite=True)  # 2 parts: old ones removed
    second = lake.read_partition("2024-01-02")
    assert len(second.files) == 2 and len(second.frame) == 25_000 and second.generation != first.generation
    assert sorted(lake.objects("2024-01-02")) == sorted(
        second.files + [f"{lake.partition_uri('2024-01-02')}/_MANIFEST.json"]
    )
    pd.testing.assert_frame_equal(second.frame, first.frame)


def test_write_days_to_s3_with_progress(s3_bucket, capsys):
    lake = Lake(f"s3://{s3_bucket}/synthetic")
    assert write_days(lake, SMALL, "2024-02-01", 2, 3_000, chunk_rows=2_000, progress=True) == [
        "2024-02-01",
        "2024-02-02",
    ]
    assert lake.list_partitions() == ["2024-02-01", "2024-02-02"]
    assert len(lake.read_partition("2024-02-02").files) == 2
    assert len(lake.read_window("2024-02-02", 2)) == 2
    assert "rows" in capsys.readouterr().err  # the tqdm bar went to stderr


# ---------------------------------------------------------------------------- cold start
def test_new_users_and_items_appear_on_later_days():
    d0 = day(SMALL, D0, 30_000)
    assert (num(d0["user_id"]) < SMALL.n_users).all() and (num(d0["item_id"]) < SMALL.n_items).all()
    d5 = day(SMALL, "2024-01-06", 30_000)  # day 5
    unseen = ~d5["user_id"].isin(set(d0["user_id"]))
    assert unseen.mean() > SMALL.new_entity_rate  # fresh ids + cohorts + tail users
    for col, n_base, per_day in (
        ("user_id", SMALL.n_users, SMALL.new_users_per_day),
        ("item_id", SMALL.n_items, SMALL.new_items_per_day),
    ):
        ids = num(d5[col])
        born_today = ids >= n_base + 4 * per_day
        assert born_today.mean() == pytest.approx(SMALL.new_entity_rate, abs=0.01), col
        assert (ids < n_base + 5 * per_day).all(), col  # nobody born in the future
        assert ((ids >= n_base) & ~born_today).any(), col  # earlier cohorts come back
    d6 = day(SMALL, "2024-01-07", 30_000)
    born_day5 = d5["user_id"][num(d5["user_id"]) >= SMALL.n_users + 4 * SMALL.new_users_per_day]
    assert d6["user_id"].isin(set(born_day5)).any()  # yesterday's new users return
    # ids born on day 5 never occur on earlier days
    for d in ("2024-01-02", "2024-01-05"):
        assert not day(SMALL, d, 30_000)["user_id"].isin(set(born_day5)).any()


def test_no_new_entities_when_rate_is_zero():
    spec = dataclasses.replace(SMALL, new_entity_rate=0.0)
    df = day(spec, "2024-02-01", 20_000)
    assert (num(df["user_id"]) < spec.n_users).all() and (num(df["item_id"]) < spec.n_items).all()


def test_popularity_is_skewed():
    df = day(SMALL, D0, 50_000)
    for col, n in (("user_id", SMALL.n_users), ("item_id", SMALL.n_items)):
        counts = df[col].value_counts()
        top = counts.iloc[: max(1, n // 100)].sum() / len(df)  # top 1 % of ids
        assert top > 0.05, (col, top)  # uniform would give ~1 %


# ---------------------------------------------------------------------------- click model
def test_slot_ctrs_ordered_and_close_to_targets(big_day):
    ctr = big_day.groupby("slot")["label"].mean()
    assert ctr["search"] > ctr["feed"] > ctr["splash"]
    for slot, target in zip(SLOTS, SyntheticSpec().slot_ctr):
        assert ctr[slot] == pytest.approx(target, rel=0.15), slot
    mix = big_day["slot"].value_counts(normalize=True)
    for slot, share in zip(SLOTS, SyntheticSpec().slot_mix):
        assert mix[slot] == pytest.approx(share, abs=0.01)


def test_slot_ctr_targets_follow_the_spec():
    spec = SyntheticSpec(slot_ctr=(0.10, 0.02, 0.05), slot_mix=(1 / 3, 1 / 3, 1 / 3), seed=5)
    ctr = day(spec, "2024-01-02", 150_000).groupby("slot")["label"].mean()
    assert ctr["feed"] > ctr["splash"] > ctr["search"]


def test_clicks_are_learnable(big_day):
    """Side features carry signal: a logistic model on one-hot fields beats chance on the next day."""
    fields = ["slot", "age_bucket", "gender", "occupation", "category", "hour", "advertiser_id"]
    test = day(SyntheticSpec(seed=3), "2024-01-05", 100_000)
    enc = OneHotEncoder(handle_unknown="ignore").fit(big_day[fields].astype(str))
    model = LogisticRegression(max_iter=500).fit(enc.transform(big_day[fields].astype(str)), big_day["label"])
    auc = roc_auc_score(test["label"], model.predict_proba(enc.transform(test[fields].astype(str)))[:, 1])
    assert auc > 0.65
    # the evening peak of the hour-of-day effect
    by_hour = big_day.groupby("hour")["label"].mean()
    assert by_hour.loc[18:23].mean() > by_hour.loc[5:10].mean()


# ---------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "field,value",
    [
        ("n_users", 0),
        ("n_items", -1),
        ("n_advertisers", 2.5),
        ("n_users", True),
        ("new_entity_rate", 1.0),
        ("new_entity_rate", -0.1),
        ("new_entity_rate", "0.1"),
        ("new_users_per_day", -1),
        ("slot_mix", (0.5, 0.5)),
        ("slot_mix", (0.6, 0.3, 0.3)),
        ("slot_mix", (1.2, -0.1, -0.1)),
        ("slot_ctr", (0.03, 0.0, 0.01)),
        ("slot_ctr", (0.03, 0.6, 0.01)),
        ("user_zipf", 0),
        ("item_zipf", -1.0),
        ("origin_day", "2024-13-01"),
        ("seed", -1),
        ("seed", 1.5),
    ],
)
def test_spec_validation(field, value):
    with pytest.raises(ConfigError, match=field):
        SyntheticSpec(**{field: value})


def test_spec_validation_new_entities_need_room():
    with pytest.raises(ConfigError, match="new_users_per_day"):
        SyntheticSpec(new_entity_rate=0.1, new_users_per_day=0)
    SyntheticSpec(new_entity_rate=0.0, new_users_per_day=0, new_items_per_day=0)  # fine


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        SyntheticSpec(n_users=0)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(day="2023-12-31", rows=10), "before synthetic.origin_day"),
        (dict(day="2024-02-30", rows=10), "ISO date"),
        (dict(day="2024-01-02", rows=0), "rows"),
        (dict(day="2024-01-02", rows=10, chunk_rows=0), "chunk_rows"),
    ],
)
def test_generate_day_argument_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        generate_day(SMALL, **kwargs)  # checked on the call, not on the first next()


def test_write_days_argument_errors(tmp_path):
    lake = Lake(str(tmp_path))
    with pytest.raises(ConfigError, match="days"):
        write_days(lake, SMALL, "2024-01-01", 0, 10)
    with pytest.raises(ConfigError, match="rows_per_day"):
        write_days(lake, SMALL, "2024-01-01", 1, 0)
    with pytest.raises(ConfigError, match="origin_day"):
        write_days(lake, SMALL, "2023-12-30", 3, 10)  # starts before day 0: nothing written
    assert lake.list_partitions() == []
