"""Partition commits (pipelines.data.commit): a lake that never loses data.

A writer killed mid-partition (a real subprocess, SIGKILL) leaves the previous commit readable and
unchanged, on a local lake and on S3 over HTTP (moto's server); a re-run commits. Replacing needs
`overwrite`; S3's per-key delete errors raise; a second writer cannot clobber a commit it did not see.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest

from pipelines.data import commit
from pipelines.data.commit import PartitionExistsError, PartitionWriter, UncommittedPartitionError
from pipelines.data.lake import Lake
from pipelines.data.synthetic import SyntheticSpec, generate_day, write_days
from pipelines.errors import LakeError
from tests.pipelines.data.s3_faults import deny_deletes
from tests.pipelines.data.test_lake import contract_frame

SPEC = SyntheticSpec(n_users=2_000, n_items=300, n_advertisers=30, new_users_per_day=100, new_items_per_day=10, seed=5)
DAY = "2024-01-03"
BIG, CHUNK = 600_000, 2_000  # 300 parts: the kill lands long before the writer could finish

# The writer under test, as `generate` runs it, in its own process so that it can be killed -9.
WRITER = """
import sys
from pipelines.data.lake import Lake
from pipelines.data.synthetic import SyntheticSpec, write_days
spec = SyntheticSpec(n_users=2_000, n_items=300, n_advertisers=30, new_users_per_day=100, new_items_per_day=10, seed=5)
write_days(Lake(sys.argv[1]), spec, sys.argv[2], 1, int(sys.argv[3]), chunk_rows=int(sys.argv[4]), overwrite=True)
"""


@pytest.fixture(params=["local", "s3"])
def lake(request, tmp_path) -> Lake:
    if request.param == "local":
        return Lake(str(tmp_path / "lake"))
    return Lake(f"s3://{request.getfixturevalue('s3_bucket')}/clicks")


def names(lake: Lake, day: str) -> set[str]:
    return {k.rsplit("/", 1)[-1] for k in lake.objects(day)}


def contents(lake: Lake, day: str) -> dict[str, bytes]:
    return {k.rsplit("/", 1)[-1]: lake._get(k) for k in lake.objects(day)}


def kill_writer_mid_partition(lake: Lake, day: str, old_parts: set[str], at_least: int = 3) -> set[str]:
    """Start WRITER on `day`, SIGKILL it once `at_least` parts of its generation exist; returns their names."""
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, lake.uri, day, str(BIG), str(CHUNK)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            new = {n for n in names(lake, day) if n.endswith(".parquet") and n not in old_parts}
            if len(new) >= at_least:
                os.kill(proc.pid, signal.SIGKILL)
                break
            assert proc.poll() is None, f"the writer ended before it was killed: {proc.stdout.read().decode()}"
            time.sleep(0.01)
        else:
            pytest.fail("the writer wrote no parts within 120 s")
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    return {n for n in names(lake, day) if n.endswith(".parquet") and n not in old_parts}


def test_a_writer_killed_mid_partition_leaves_the_previous_commit_readable_and_unchanged(lake):
    write_days(lake, SPEC, DAY, 1, 3_000, chunk_rows=1_000)
    before = lake.read_partition(DAY)
    objects_before = contents(lake, DAY)

    strays = kill_writer_mid_partition(lake, DAY, set(objects_before))

    assert len(strays) >= 3  # it was killed mid-partition ...
    assert {
        n: b for n, b in contents(lake, DAY).items() if n in objects_before
    } == objects_before  # ... nothing touched
    after = lake.read_partition(DAY)  # the previous commit, exactly
    assert (after.generation, after.sha256, after.files) == (before.generation, before.sha256, before.files)
    pd.testing.assert_frame_equal(after.frame, before.frame)
    assert lake.list_partitions() == [DAY] and lake.uncommitted_partitions() == []
    with pytest.raises(PartitionExistsError, match=f"dt={DAY}"):  # a plain re-run does not replace it ...
        write_days(lake, SPEC, DAY, 1, 20_000, chunk_rows=10_000)

    write_days(lake, SPEC, DAY, 1, 20_000, chunk_rows=10_000, overwrite=True)  # ... a re-run with overwrite commits
    rerun = lake.read_partition(DAY)
    assert rerun.generation not in (before.generation, *(s[len("part-00000-") : -len(".parquet")] for s in strays))
    pd.testing.assert_frame_equal(rerun.frame, pd.concat(list(generate_day(SPEC, DAY, 20_000)), ignore_index=True))
    # old parts and the killed writer's strays are gone; markers would have stayed
    assert names(lake, DAY) == {commit.MANIFEST} | {f.rsplit("/", 1)[-1] for f in rerun.files}


def test_a_first_write_killed_mid_partition_is_absent_until_a_re_run_commits_it(lake, caplog):
    strays = kill_writer_mid_partition(lake, DAY, set())

    assert strays and commit.MANIFEST not in names(lake, DAY)
    assert lake.list_partitions() == [] and lake.uncommitted_partitions() == [DAY]
    with caplog.at_level("WARNING", logger="pipelines.data.lake"):
        assert lake.read_window(DAY, 3) == []  # a reader of the window skips it ...
    assert f"dt={DAY} has objects but no _MANIFEST.json" in caplog.text  # ... and says so
    with pytest.raises(UncommittedPartitionError, match=f"dt={DAY} is not committed"):
        lake.read_partition(DAY)  # asked for by name: a clear error
    assert lake.parquet_files(DAY) == []  # the arrival sensor keeps waiting

    write_days(lake, SPEC, DAY, 1, 5_000, chunk_rows=2_500)  # nothing committed: no overwrite needed
    part = lake.read_partition(DAY)
    assert len(part.frame) == 5_000 and lake.list_partitions() == [DAY]
    assert names(lake, DAY) == {commit.MANIFEST} | {f.rsplit("/", 1)[-1] for f in part.files}


def test_overwrite_is_refused_without_the_flag(lake):
    lake.write_partition(contract_frame(DAY, 10), DAY)
    with pytest.raises(PartitionExistsError, match=f"dt={DAY}: refusing .*overwrite=True"):
        lake.write_partition(contract_frame(DAY, 5), DAY)
    with pytest.raises(PartitionExistsError):
        PartitionWriter(lake, DAY)
    with pytest.raises(PartitionExistsError) as info:  # named before anything is written
        write_days(lake, SPEC, "2024-01-01", 4, 100)
    assert info.value.days == [DAY] and lake.list_partitions() == [DAY]
    assert len(lake.read_partition(DAY).frame) == 10


def test_s3_delete_errors_are_raised_and_the_commit_stands(s3_bucket, s3_endpoint):
    direct = Lake(f"s3://{s3_bucket}/clicks")
    direct.write_partition(contract_frame(DAY, 10, seed=1), DAY)
    old = set(direct.parquet_files(DAY))
    with deny_deletes(s3_endpoint) as proxy:
        refused = Lake(direct.uri, endpoint_url=proxy.url)
        with pytest.raises(LakeError, match=r"could not delete 1 of 1 objects .*AccessDenied: Access Denied"):
            refused.write_partition(contract_frame(DAY, 20, seed=2), DAY, overwrite=True)
        assert len(proxy.faulted) == 1
    new = direct.read_partition(DAY)  # the new manifest is the commit ...
    assert len(new.frame) == 20 and not old & set(new.files)
    assert old <= set(direct.objects(DAY))  # ... the old part stays, unread
    direct.write_partition(contract_frame(DAY, 30, seed=3), DAY, overwrite=True)  # the next commit removes it
    assert not old & set(direct.objects(DAY)) and len(direct.objects(DAY)) == 2


def test_a_writer_cannot_commit_over_a_commit_it_did_not_see(lake):
    lake.write_partition(contract_frame(DAY, 10, seed=1), DAY)
    slow = PartitionWriter(lake, DAY, overwrite=True)
    slow.write_frame(contract_frame(DAY, 15, seed=2))
    lake.write_partition(contract_frame(DAY, 20, seed=3), DAY, overwrite=True)  # another writer commits first
    with pytest.raises(LakeError, match="committed by another writer"):
        slow.commit()
    assert len(lake.read_partition(DAY).frame) == 20


def test_a_failing_writer_leaves_the_partition_as_it_was(lake):
    lake.write_partition(contract_frame(DAY, 10, seed=1), DAY)
    before = contents(lake, DAY)

    def frames():
        yield contract_frame(DAY, 5, seed=2)
        raise RuntimeError("the source went away")

    with pytest.raises(RuntimeError, match="went away"):
        commit.write_frames(lake, DAY, frames(), overwrite=True)
    assert contents(lake, DAY) == before  # its own part removed, the commit intact
    with pytest.raises(LakeError, match="nothing to commit"):
        PartitionWriter(lake, "2024-01-04").commit()
    with pytest.raises(LakeError, match="not a partition day"):
        PartitionWriter(lake, "2024-1-4")
