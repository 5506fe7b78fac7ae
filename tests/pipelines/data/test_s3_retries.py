"""The lake rides out transient S3 failures and fails clearly beyond its retry budget.

`FaultProxy` (tests/pipelines/data/s3_faults.py) stands between the library and the real moto S3
server (over HTTP): it spoils the first N requests that match with a 503, a reset connection, or a
body cut off mid-way, and forwards every other request untouched. Nothing reaches our code but HTTP;
tests/pipelines/registry/
test_mlflow_retries.py puts the same proxy in front of a real `mlflow server`.
"""

from __future__ import annotations

import pytest

from pipelines.data import lake as lake_mod
from pipelines.data.lake import Lake
from pipelines.errors import LakeError
from tests.pipelines.data.s3_faults import FaultProxy
from tests.pipelines.data.test_lake import contract_frame


def object_get(method: str, path: str) -> bool:
    """A GET of one object (not a listing: those carry a query string)."""
    return method == "GET" and "?" not in path


def object_put(method: str, path: str) -> bool:
    return method == "PUT"


@pytest.fixture
def legacy_mode_in_env(monkeypatch):
    """AWS_RETRY_MODE=legacy and no AWS_MAX_ATTEMPTS in the environment: the library's config must win."""
    monkeypatch.delenv("AWS_MAX_ATTEMPTS", raising=False)
    monkeypatch.setenv("AWS_RETRY_MODE", "legacy")  # must not win over the library's own config


@pytest.mark.parametrize("fault", ["503", "reset"])
def test_writes_and_reads_survive_transient_failures(s3_bucket, s3_endpoint, legacy_mode_in_env, fault):
    frame = contract_frame("2024-01-01", 40, seed=5)
    with FaultProxy(s3_endpoint, fault, failures=2, match=object_put) as proxy:
        Lake(f"s3://{s3_bucket}/clicks", endpoint_url=proxy.url).write_partition(frame, "2024-01-01")
    assert len(proxy.faulted) == 2 and any(m == "PUT" for m, _ in proxy.forwarded)
    with FaultProxy(s3_endpoint, fault, failures=2, match=object_get) as proxy:
        part = Lake(f"s3://{s3_bucket}/clicks", endpoint_url=proxy.url).read_partition("2024-01-01")
    assert len(proxy.faulted) == 2
    assert part.frame.reset_index(drop=True).equals(frame.reset_index(drop=True))


def test_beyond_the_retry_budget_a_clear_lake_error(s3_bucket, s3_endpoint, monkeypatch):
    Lake(f"s3://{s3_bucket}/clicks").write_partition(contract_frame("2024-01-01", 10), "2024-01-01")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "3")
    with FaultProxy(s3_endpoint, "503", failures=1000, match=object_get) as proxy:
        with pytest.raises(LakeError) as err:
            Lake(f"s3://{s3_bucket}/clicks", endpoint_url=proxy.url).read_partition("2024-01-01")
    msg = str(err.value)
    assert f"cannot read s3://{s3_bucket}/clicks/dt=2024-01-01/" in msg and "reached max retries: 2" in msg
    # one object read, three attempts: the budget is what it says, and nothing more was attempted
    assert len(proxy.faulted) == 3 and len({p for _, p in proxy.faulted}) == 1


def test_a_deterministic_error_is_not_retried(s3_bucket, s3_endpoint):
    """A missing object answers 404 once: retrying it would only delay the refusal."""
    with FaultProxy(s3_endpoint, "503", failures=0) as proxy:
        lake = Lake(f"s3://{s3_bucket}/clicks", endpoint_url=proxy.url)
        with pytest.raises(LakeError, match="cannot read"):
            lake.get_bytes("dt=2024-01-01/nothing.parquet")
    assert [m for m, p in proxy.forwarded if p.endswith("nothing.parquet")] == ["GET"]


def test_every_client_uses_standard_retries(monkeypatch):
    monkeypatch.setenv("AWS_RETRY_MODE", "legacy")
    monkeypatch.delenv("AWS_MAX_ATTEMPTS", raising=False)
    retries = lake_mod.s3_client("http://127.0.0.1:9").meta.config.retries
    assert retries == {"mode": "standard", "total_max_attempts": lake_mod.S3_MAX_ATTEMPTS}
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "4")
    assert Lake("s3://b/x", endpoint_url="http://127.0.0.1:9").client.meta.config.retries["total_max_attempts"] == 4
    for bad in ("0", "-1", "many"):
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", bad)
        with pytest.raises(LakeError, match="AWS_MAX_ATTEMPTS"):
            lake_mod.s3_client()


def test_a_body_cut_off_midway_fails_closed(s3_bucket, s3_endpoint):
    """botocore retries until a response starts; a body that then breaks off is not retried. The read
    must fail naming the object, never hand back a short part (the Airflow task retries it)."""
    Lake(f"s3://{s3_bucket}/clicks").write_partition(contract_frame("2024-01-01", 200), "2024-01-01")
    with FaultProxy(s3_endpoint, "truncate", failures=1000, match=object_get) as proxy:
        with pytest.raises(LakeError, match=f"cannot read s3://{s3_bucket}/clicks/dt=2024-01-01/"):
            Lake(f"s3://{s3_bucket}/clicks", endpoint_url=proxy.url).read_partition("2024-01-01")
