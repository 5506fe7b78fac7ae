"""The click-log lake, over HTTP against the moto S3 server and on a local directory."""

from __future__ import annotations

from pathlib import Path

import boto3
import numpy as np
import pandas as pd
import pytest

from pipelines.data import commit
from pipelines.data import lake as lake_mod
from pipelines.data import schema
from pipelines.data.commit import PartitionExistsError, PartitionWriter, UncommittedPartitionError
from pipelines.data.lake import Lake
from pipelines.errors import LakeError


def contract_frame(day: str, n: int, seed: int = 0, with_advertiser: bool = True) -> pd.DataFrame:
    """n contract rows on `day`, already conformed (what read_partition must give back)."""
    rng = np.random.default_rng(seed)
    ts = pd.Timestamp(day, tz="UTC") + pd.to_timedelta(np.sort(rng.integers(0, 86_400_000_000, n)), unit="us")
    df = pd.DataFrame(
        {
            "event_ts": ts,
            "user_id": [f"u{i}" for i in rng.integers(0, 50, n)],
            "item_id": [f"i{i}" for i in rng.integers(0, 20, n)],
            "slot": rng.choice(["feed", "search", "splash"], n),
            "label": rng.integers(0, 2, n),
            "age_bucket": rng.choice(["18-24", "25-34", None], n),
            "gender": rng.choice(["M", "F"], n),
            "occupation": rng.choice(["student", "other"], n),
            "category": rng.choice(["auto", "food"], n),
            "hour": ts.hour,
            "weekday": ts.dayofweek,
        }
    )
    if with_advertiser:
        df["advertiser_id"] = [f"a{i}" for i in rng.integers(0, 5, n)]
    return schema.conform(df)


@pytest.fixture
def s3_lake(s3_bucket):
    return Lake(f"s3://{s3_bucket}/clicks")


def keys(bucket: str) -> list[str]:
    out = boto3.client("s3").list_objects_v2(Bucket=bucket).get("Contents", [])
    return sorted(o["Key"] for o in out)


def write_parts(lake: Lake, day: str, *frames: pd.DataFrame) -> commit.Manifest:
    """Several part files of one partition, committed together."""
    return commit.write_frames(lake, day, list(frames))


# ---------------------------------------------------------------------------- S3 over HTTP (moto server)
def test_s3_round_trip(s3_bucket, s3_endpoint, s3_lake):
    a0, a1 = contract_frame("2024-01-01", 30, seed=1), contract_frame("2024-01-01", 20, seed=2)
    b = contract_frame("2024-01-02", 25, seed=3)
    man = write_parts(s3_lake, "2024-01-01", a0, a1)
    assert s3_lake.write_partition(b, "2024-01-02") == f"s3://{s3_bucket}/clicks/dt=2024-01-02/_MANIFEST.json"
    s3_lake.write_marker("2024-01-02", "SUCCESS", {"rows": 25})

    g1, g2 = man.generation, s3_lake.manifest("2024-01-02").generation
    assert keys(s3_bucket) == sorted(
        [
            "clicks/dt=2024-01-01/_MANIFEST.json",
            f"clicks/dt=2024-01-01/part-00000-{g1}.parquet",
            f"clicks/dt=2024-01-01/part-00001-{g1}.parquet",
            "clicks/dt=2024-01-02/_MANIFEST.json",
            "clicks/dt=2024-01-02/_SUCCESS.json",
            f"clicks/dt=2024-01-02/part-00000-{g2}.parquet",
        ]
    )
    assert s3_lake.list_partitions() == ["2024-01-01", "2024-01-02"]
    assert man.rows == 50 and [p.rows for p in man.parts] == [30, 20]

    got = s3_lake.read_partition("2024-01-01")
    assert got.dt == "2024-01-01" and got.uri == f"s3://{s3_bucket}/clicks/dt=2024-01-01"
    assert got.files == [
        f"clicks/dt=2024-01-01/part-00000-{g1}.parquet",
        f"clicks/dt=2024-01-01/part-00001-{g1}.parquet",
    ]
    assert got.sha256 == man.sha256 and got.generation == g1
    assert s3_lake.parquet_files("2024-01-01") == got.files
    pd.testing.assert_frame_equal(got.frame, pd.concat([a0, a1], ignore_index=True))
    pd.testing.assert_frame_equal(s3_lake.read_partition("2024-01-02").frame, b)  # marker json is not read
    # an explicit endpoint_url (as the Airflow connection passes it) reaches the same server
    explicit = Lake(f"s3://{s3_bucket}/clicks/", endpoint_url=s3_endpoint)
    assert explicit.list_partitions() == ["2024-01-01", "2024-01-02"]
    assert explicit.read_partition("2024-01-02").sha256 == s3_lake.read_partition("2024-01-02").sha256


def test_s3_write_conforms_raw_frames(s3_lake):
    raw = contract_frame("2024-01-01", 10).astype({"label": "int64", "hour": "int64"})
    raw["user_id"] = raw["user_id"].astype(object)
    s3_lake.write_partition(raw, "2024-01-01")
    pd.testing.assert_frame_equal(s3_lake.read_partition("2024-01-01").frame, schema.conform(raw))


def test_s3_sha256_stable_and_content_sensitive(s3_lake):
    frame = contract_frame("2024-01-01", 40)
    s3_lake.write_partition(frame, "2024-01-01")
    first = s3_lake.read_partition("2024-01-01").sha256
    assert len(first) == 64
    assert s3_lake.read_partition("2024-01-01").sha256 == first
    assert Lake(s3_lake.uri).read_partition("2024-01-01").sha256 == first  # a fresh client too

    changed = frame.copy()
    changed.loc[0, "label"] = 1 - changed.loc[0, "label"]
    with pytest.raises(PartitionExistsError, match="dt=2024-01-01"):
        s3_lake.write_partition(changed, "2024-01-01")  # a committed partition is not replaced by default
    assert s3_lake.read_partition("2024-01-01").sha256 == first
    s3_lake.write_partition(changed, "2024-01-01", overwrite=True)  # replaced, not appended
    second = s3_lake.read_partition("2024-01-01")
    assert second.sha256 != first
    assert len(second.frame) == 40
    assert len(s3_lake.parquet_files("2024-01-01")) == 1 and len(s3_lake.objects("2024-01-01")) == 2


def test_s3_read_window(s3_lake):
    for i, day in enumerate(["2024-01-01", "2024-01-02", "2024-01-04", "2024-01-05"]):
        s3_lake.write_partition(contract_frame(day, 5 + i, seed=i), day)
    assert [p.dt for p in s3_lake.read_window("2024-01-04", 3)] == ["2024-01-02", "2024-01-04"]
    assert [p.dt for p in s3_lake.read_window("2024-01-05", 1)] == ["2024-01-05"]
    assert [p.dt for p in s3_lake.read_window("2024-01-03", 10)] == ["2024-01-01", "2024-01-02"]
    assert [p.dt for p in s3_lake.read_window("2024-01-05", 1, start_day="2024-01-02")] == [
        "2024-01-02",
        "2024-01-04",
        "2024-01-05",
    ]
    assert s3_lake.read_window("2023-12-31", 7) == []
    parts = s3_lake.read_window("2024-01-05", 2)
    assert len(lake_mod.concat(parts)) == 7 + 8
    lin = lake_mod.lineage(parts)
    assert lin["first"] == "2024-01-04" and lin["last"] == "2024-01-05" and lin["count"] == 2
    assert lin["partitions"] == {p.dt: p.sha256 for p in parts}
    assert lake_mod.lineage(s3_lake.read_window("2024-01-05", 2))["sha256"] == lin["sha256"]


def test_s3_lake_at_bucket_root(s3_bucket):
    root = Lake(f"s3://{s3_bucket}")
    root.write_partition(contract_frame("2024-01-01", 5), "2024-01-01")
    assert keys(s3_bucket) == [
        "dt=2024-01-01/_MANIFEST.json",
        f"dt=2024-01-01/part-00000-{root.manifest('2024-01-01').generation}.parquet",
    ]
    assert root.list_partitions() == ["2024-01-01"]
    assert len(root.read_partition("2024-01-01").frame) == 5


def test_s3_missing_partition(s3_lake):
    s3_lake.write_partition(contract_frame("2024-01-01", 5), "2024-01-01")
    with pytest.raises(LakeError, match="dt=2024-01-09"):
        s3_lake.read_partition("2024-01-09")


def test_s3_partition_with_objects_but_no_manifest_is_absent(s3_lake):
    s3_lake.write_marker("2024-01-01", "SUCCESS", {})
    s3_lake.put_bytes("dt=2024-01-01/part-00000.parquet", b"a part nobody committed")
    assert s3_lake.list_partitions() == [] and s3_lake.uncommitted_partitions() == ["2024-01-01"]
    assert s3_lake.parquet_files("2024-01-01") == [] and s3_lake.read_window("2024-01-01", 1) == []
    with pytest.raises(UncommittedPartitionError, match=r"dt=2024-01-01 is not committed \(no _MANIFEST.json\)"):
        s3_lake.read_partition("2024-01-01")


def test_s3_object_that_is_not_parquet_is_named(s3_bucket, s3_lake):
    writer = PartitionWriter(s3_lake, "2024-01-01")
    writer.write_frame(contract_frame("2024-01-01", 5))
    writer.put_part(b"this is not parquet")
    writer.commit()
    with pytest.raises(LakeError) as info:
        s3_lake.read_partition("2024-01-01")
    assert f"clicks/dt=2024-01-01/part-00001-{writer.generation}.parquet" in str(info.value)
    assert "not readable parquet" in str(info.value)


def test_s3_parts_with_different_schemas(s3_lake):
    write_parts(
        s3_lake,
        "2024-01-01",
        contract_frame("2024-01-01", 5, with_advertiser=True),
        contract_frame("2024-01-01", 5, with_advertiser=False),
    )
    with pytest.raises(LakeError, match="disagree on schema"):
        s3_lake.read_partition("2024-01-01")


def test_s3_missing_bucket_is_lake_error(s3_endpoint):
    gone = Lake("s3://no-such-bucket-here/clicks")
    with pytest.raises(LakeError, match="no-such-bucket-here"):
        gone.list_partitions()
    with pytest.raises(LakeError, match="no-such-bucket-here"):
        gone.read_partition("2024-01-01")
    with pytest.raises(LakeError, match="no-such-bucket-here"):
        gone.write_partition(contract_frame("2024-01-01", 3), "2024-01-01")


def test_not_an_s3_uri():
    with pytest.raises(LakeError):
        lake_mod.split_s3("s3:///key")


# ---------------------------------------------------------------------------- local directory
@pytest.mark.parametrize("scheme", ["", "file://"])
def test_local_round_trip(tmp_path, scheme):
    lake = Lake(f"{scheme}{tmp_path}/clicks")
    a0, a1 = contract_frame("2024-03-01", 12, seed=1), contract_frame("2024-03-01", 8, seed=2)
    b = contract_frame("2024-03-03", 9, seed=3, with_advertiser=False)
    assert lake.list_partitions() == []  # directory does not exist yet
    gen = write_parts(lake, "2024-03-01", a0, a1).generation
    lake.write_partition(b, "2024-03-03")
    lake.write_marker("2024-03-03", "SUCCESS", {"rows": 9})
    (tmp_path / "clicks" / "not-a-partition").mkdir()
    (tmp_path / "clicks" / "dt=2024-03-09.txt").write_text("a file, not a partition")

    assert (tmp_path / "clicks" / "dt=2024-03-01" / f"part-00001-{gen}.parquet").is_file()
    assert lake.list_partitions() == ["2024-03-01", "2024-03-03"]
    got = lake.read_partition("2024-03-01")
    assert [f.rsplit("/", 1)[-1] for f in got.files] == [f"part-00000-{gen}.parquet", f"part-00001-{gen}.parquet"]
    pd.testing.assert_frame_equal(got.frame, pd.concat([a0, a1], ignore_index=True))
    pd.testing.assert_frame_equal(lake.read_partition("2024-03-03").frame, b)
    assert lake.read_partition("2024-03-01").sha256 == got.sha256
    assert [p.dt for p in lake.read_window("2024-03-03", 2)] == ["2024-03-03"]
    assert [p.dt for p in lake.read_window("2024-03-03", 3)] == ["2024-03-01", "2024-03-03"]


def test_local_same_bytes_same_hash_on_s3(tmp_path, s3_lake):
    """The content hash is a property of the bytes, not of where they are stored."""
    frame = contract_frame("2024-01-01", 30)
    local = Lake(str(tmp_path))
    local.write_partition(frame, "2024-01-01")
    s3_lake.write_partition(frame, "2024-01-01")
    assert local.read_partition("2024-01-01").sha256 == s3_lake.read_partition("2024-01-01").sha256


def test_local_errors(tmp_path):
    lake = Lake(str(tmp_path))
    with pytest.raises(LakeError, match="missing"):
        lake.read_partition("2024-01-01")
    lake.write_partition(contract_frame("2024-01-01", 5), "2024-01-01")
    stray = tmp_path / "dt=2024-01-01" / "part-00001.parquet"
    stray.write_bytes(b"PAR1 garbage")  # not in the manifest: not read
    assert len(lake.read_partition("2024-01-01").frame) == 5
    (committed,) = lake.parquet_files("2024-01-01")
    Path(committed).write_bytes(Path(committed).read_bytes()[:-8] + b"PAR1PAR1")  # replaced after its commit
    with pytest.raises(LakeError, match="changed after it was committed"):
        lake.read_partition("2024-01-01")
    write_parts(
        lake, "2024-01-02", contract_frame("2024-01-02", 5), contract_frame("2024-01-02", 5, with_advertiser=False)
    )
    with pytest.raises(LakeError, match="disagree on schema"):
        lake.read_partition("2024-01-02")
    (tmp_path / "dt=2024-01-03").mkdir()
    (tmp_path / "dt=2024-01-03" / "_MANIFEST.json").write_text("{not json")
    with pytest.raises(LakeError, match="dt=2024-01-03/_MANIFEST.json is not a valid lake manifest"):
        lake.read_partition("2024-01-03")


def test_concat_of_nothing_is_lake_error():
    with pytest.raises(LakeError, match="no partitions"):
        lake_mod.concat([])
