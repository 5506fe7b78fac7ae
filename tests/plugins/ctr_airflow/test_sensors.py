"""LakePartitionSensor: thin (keyword-only, templated, no I/O at construction), pokes a real lake (moto's
S3 server over HTTP, a local directory), and through BaseSensorOperator's own execute(): found =>
done with an XCom, missing => rescheduled (slot freed), missing past the timeout => skipped (never
failed), unlistable lake => a failure that soft_fail does not turn into a skip.

The full Airflow run (reschedule through the metadata DB, the skipped run, the asset event) is
tests/e2e/test_lake_arrival_dag.py."""

from __future__ import annotations

import datetime as dt
import inspect
import json

import pytest
from airflow.sdk.exceptions import AirflowFailException, AirflowRescheduleException, AirflowSkipException

from ctr_airflow.sensors import LakePartitionSensor, LakeUnreachable
from pipelines.data.lake import Lake
from pipelines.errors import ConfigError
from pipelines.data.synthetic import SyntheticSpec, write_days

DAY, MISSING = "2024-01-03", "2024-01-04"
SPEC = SyntheticSpec(n_users=50, n_items=20, n_advertisers=5, new_entity_rate=0.0, seed=3)


def lake_with_day(uri: str) -> Lake:
    """A lake holding DAY (real parquet from the synthetic generator) and, for MISSING, only a marker:
    a partition directory without data is not an arrived partition."""
    lake = Lake(uri)
    write_days(lake, SPEC, DAY, 1, 200)
    lake.put_bytes(f"dt={MISSING}/_validation.json", b"{}")
    return lake


def allow(lake_uri: str, tmp_path, monkeypatch) -> None:
    """A pipeline config that lets a run be pointed at `lake_uri` (data.allowed_lakes)."""
    config = tmp_path / "allowing.yaml"
    config.write_text(json.dumps({"data": {"lake_uri": "s3://configured/clicks", "allowed_lakes": [lake_uri]}}))
    monkeypatch.setenv("CTR_PIPELINE_CONFIG", str(config))


@pytest.fixture
def s3_lake(s3_bucket, tmp_path, monkeypatch) -> Lake:
    allow(f"s3://{s3_bucket}/clicks", tmp_path, monkeypatch)
    return lake_with_day(f"s3://{s3_bucket}/clicks")


@pytest.fixture
def local_lake(tmp_path, monkeypatch) -> Lake:
    allow(str(tmp_path / "lake"), tmp_path, monkeypatch)
    return lake_with_day(str(tmp_path / "lake"))


class FirstPokedAt:
    """The one TaskInstance method a reschedule-mode sensor calls: when its first poke was (None: this
    is the first). In a real run it comes from the task_reschedule table (see the e2e test)."""

    def __init__(self, when: dt.datetime | None):
        self.when = when

    def get_first_reschedule_date(self, context):
        return self.when


def context(first_poke: dt.datetime | None = None, **params) -> dict:
    return {"ti": FirstPokedAt(first_poke), "params": params, "task_reschedule_count": 0 if first_poke is None else 1}


def test_keyword_only_templated_and_safe_by_default():
    own = [
        p for n, p in inspect.signature(LakePartitionSensor.__init__).parameters.items() if n not in ("self", "kwargs")
    ]
    assert own and all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in own)
    assert set(LakePartitionSensor.template_fields) == {"day", "lake_uri", "wait_timeout_s"}
    s = LakePartitionSensor(task_id="w")
    assert s.mode == "reschedule" and s.soft_fail is True
    assert s.poke_interval == 600 and s.timeout == 86400
    # A broken lake must fail (and retry), not be skipped like a late day: not an AirflowFailException,
    # which soft_fail converts into a skip.
    assert not issubclass(LakeUnreachable, AirflowFailException)


def test_construction_does_no_io(monkeypatch, tmp_path):
    # Neither the config nor the lake exists: construction must read neither.
    monkeypatch.setenv("CTR_PIPELINE_CONFIG", str(tmp_path / "missing.yaml"))
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    s = LakePartitionSensor(task_id="w", lake_uri="s3://nowhere/clicks", day="{{ params.day }}")
    assert s.lake_uri == "s3://nowhere/clicks" and s.day == "{{ params.day }}"


@pytest.mark.parametrize("lake_fixture", ["s3_lake", "local_lake"])
def test_poke_finds_a_partition_with_parquet_only(request, lake_fixture):
    lake = request.getfixturevalue(lake_fixture)
    found = LakePartitionSensor(task_id="w", lake_uri=lake.uri, day=DAY).poke({})
    assert found.is_done is True
    assert found.xcom_value == {"day": DAY, "lake_uri": lake.uri, "files": len(lake.parquet_files(DAY))}
    assert found.xcom_value["files"] >= 1
    for day in (MISSING, "2024-02-01"):  # a marker only; nothing at all
        assert LakePartitionSensor(task_id="w", lake_uri=lake.uri, day=day).poke({}).is_done is False


def test_poke_on_an_unlistable_lake_raises_a_typed_error(s3_endpoint):
    with pytest.raises(LakeUnreachable, match="no-such-bucket"):
        LakePartitionSensor(task_id="w", lake_uri="s3://no-such-bucket-ctr/clicks", day=DAY).poke({})


def test_execute_resolves_day_and_lake_from_params_and_returns_the_partition(s3_lake):
    s = LakePartitionSensor(task_id="w")
    out = s.execute(context(day=DAY, lake_uri=s3_lake.uri))
    assert out["day"] == DAY and out["lake_uri"] == s3_lake.uri and out["files"] >= 1


def test_execute_defaults_to_the_config_lake_and_the_logical_date(s3_lake, tmp_path, monkeypatch):
    config = tmp_path / "pipeline.yaml"
    config.write_text(json.dumps({"data": {"lake_uri": s3_lake.uri}}))  # JSON is YAML
    monkeypatch.setenv("CTR_PIPELINE_CONFIG", str(config))
    out = LakePartitionSensor(task_id="w").execute({**context(), "ds": DAY})
    assert (out["day"], out["lake_uri"]) == (DAY, s3_lake.uri) and out["files"] >= 1


def test_missing_day_frees_the_slot_until_the_next_poke(local_lake):
    s = LakePartitionSensor(task_id="w")
    before = dt.datetime.now(dt.timezone.utc)
    with pytest.raises(AirflowRescheduleException) as exc:
        s.execute(context(day=MISSING, lake_uri=local_lake.uri))
    # The next poke is one poke_interval away (capped by what is left of the timeout).
    assert dt.timedelta(minutes=9) < exc.value.reschedule_date - before < dt.timedelta(minutes=11)


def test_a_short_timeout_pokes_again_when_it_expires(local_lake):
    """wait_timeout_s below poke_interval: the next poke comes at the timeout (to skip), not 10 min later."""
    s = LakePartitionSensor(task_id="w", wait_timeout_s=5)
    before = dt.datetime.now(dt.timezone.utc)
    with pytest.raises(AirflowRescheduleException) as exc:
        s.execute(context(day=MISSING, lake_uri=local_lake.uri))
    assert exc.value.reschedule_date - before <= dt.timedelta(seconds=6)


def test_missing_day_past_the_timeout_is_skipped_not_failed(local_lake):
    first = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=30)
    s = LakePartitionSensor(task_id="w", wait_timeout_s="10")  # as rendered from params.wait_timeout_s
    with pytest.raises(AirflowSkipException, match="timed out"):
        s.execute(context(first, day=MISSING, lake_uri=local_lake.uri))
    assert s.timeout == 10
    # The same wait with the default timeout (a day) keeps waiting.
    with pytest.raises(AirflowRescheduleException):
        LakePartitionSensor(task_id="w", wait_timeout_s="None").execute(
            context(first, day=MISSING, lake_uri=local_lake.uri)
        )


def test_a_lake_outside_the_configs_list_is_refused_before_any_read(s3_lake):
    """A lake_uri the form field refused can still come from a template or a stale event: refused here too."""
    with pytest.raises(ConfigError, match="is not allowed"):
        LakePartitionSensor(task_id="w").execute(context(day=DAY, lake_uri="/etc"))


def test_an_unlistable_lake_fails_even_with_soft_fail(s3_endpoint, tmp_path, monkeypatch):
    allow("s3://no-such-bucket-ctr/clicks", tmp_path, monkeypatch)
    s = LakePartitionSensor(task_id="w")
    with pytest.raises(LakeUnreachable):
        s.execute(context(day=DAY, lake_uri="s3://no-such-bucket-ctr/clicks"))


def test_lake_endpoint_from_the_airflow_connection(s3_lake, s3_endpoint, monkeypatch):
    """Without AWS_ENDPOINT_URL the endpoint comes from the connection named by CTR_LAKE_AWS_CONN_ID
    (here defined the Airflow way, as an AIRFLOW_CONN_ variable)."""
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    monkeypatch.setenv("CTR_LAKE_AWS_CONN_ID", "ctr_lake")
    monkeypatch.setenv(
        "AIRFLOW_CONN_CTR_LAKE",
        json.dumps(
            {
                "conn_type": "aws",
                "login": "testing",
                "password": "testing",
                "extra": {"endpoint_url": s3_endpoint, "region_name": "us-east-1"},
            }
        ),
    )
    out = LakePartitionSensor(task_id="w").execute(context(day=DAY, lake_uri=s3_lake.uri))
    assert out["files"] >= 1
