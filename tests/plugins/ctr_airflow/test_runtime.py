"""The day and the lake a run is about, from the context Airflow gives a task: a manual run's params, the
`ctr_lake_validated` events of an asset-triggered run (built with the Task SDK's own types, the way
the task runner builds `triggering_asset_events` from the run's consumed events), the logical date."""

from __future__ import annotations

import datetime as dt
import json

import pytest
from airflow.sdk import Asset
from airflow.sdk.api.datamodels._generated import AssetEventDagRunReference, AssetReferenceAssetEventDagRun
from airflow.sdk.execution_time.comms import AssetEventDagRunReferenceResult
from airflow.sdk.execution_time.context import TriggeringAssetEventsAccessor

from ctr_airflow.assets import VALIDATED
from ctr_airflow.runtime import lake_override, pipeline_config, run_day, run_days, validated_event
from pipelines.errors import ConfigError

T0 = dt.datetime(2024, 1, 9, 2, 0, tzinfo=dt.timezone.utc)


def event(asset: Asset, extra: dict, minutes: int = 0) -> AssetEventDagRunReference:
    """One consumed asset event as the API server sends it with the run."""
    return AssetEventDagRunReference(
        asset=AssetReferenceAssetEventDagRun(name=asset.name, uri=asset.uri, extra={}),
        extra=extra,
        source_task_id="validate",
        source_dag_id="ctr_lake_arrival",
        source_run_id=f"scheduled__{minutes}",
        source_map_index=-1,
        source_aliases=[],
        timestamp=T0 + dt.timedelta(minutes=minutes),
    )


def triggered(*events: AssetEventDagRunReference, **rest) -> dict:
    """A task context of an asset-triggered run: no logical date (no `ds`), only the events."""
    accessor = TriggeringAssetEventsAccessor.build(
        AssetEventDagRunReferenceResult.from_asset_event_dag_run_reference(e) for e in events
    )
    return {"params": {"end_day": None, "lake_uri": None}, "triggering_asset_events": accessor, **rest}


def test_the_day_of_the_triggering_event():
    ctx = triggered(event(VALIDATED, {"day": "2024-01-08", "lake_uri": "s3://lake-a/clicks"}))
    assert run_day(ctx) == "2024-01-08"
    assert lake_override(ctx) == "s3://lake-a/clicks"


def test_several_queued_days_run_for_the_newest():
    """A run that consumed several days (validated while the DAG was paused) is about the newest day (its
    window holds the others), whatever order the events were recorded in; the newest event breaks a tie."""
    ctx = triggered(
        event(VALIDATED, {"day": "2024-01-08", "lake_uri": "s3://a/clicks"}, minutes=30),
        event(VALIDATED, {"day": "2024-01-07", "lake_uri": "s3://old/clicks"}, minutes=40),
        event(VALIDATED, {"day": "2024-01-08", "lake_uri": "s3://b/clicks"}, minutes=50),
        event(VALIDATED, {"day": "2024-01-06", "lake_uri": "s3://old/clicks"}, minutes=60),
    )
    assert run_day(ctx) == "2024-01-08"
    assert validated_event(ctx) == {"day": "2024-01-08", "lake_uri": "s3://b/clicks"}


def test_only_validated_events_with_a_day_count():
    other = Asset("mlflow://ctr_lora_feed/champion")
    ctx = triggered(
        event(other, {"day": "2030-01-01"}),
        event(VALIDATED, {}),
        event(VALIDATED, {"day": "2024-01-05"}),
        ds="2024-01-09",
    )
    assert run_day(ctx) == "2024-01-05"
    assert lake_override(ctx) is None  # no lake in the event: the config's lake
    assert validated_event(triggered(event(other, {"day": "2030-01-01"}))) is None


@pytest.mark.parametrize(
    "params, expected",
    [
        ({"end_day": "2024-01-02"}, "2024-01-02"),  # ctr_lora_retrain / ctr_cold_start triggered by hand
        ({"day": "2024-01-03"}, "2024-01-03"),  # ctr_champion_monitor / ctr_lake_arrival by hand
    ],
)
def test_a_day_given_by_hand_wins(params, expected):
    ctx = triggered(event(VALIDATED, {"day": "2024-01-08"}))
    ctx["params"] = params
    assert run_day(ctx) == expected


def test_without_events_the_logical_date_as_before():
    """`airflow dags test <dag> <date>` and a UI trigger with a date: no events, `ds` is the day."""
    assert run_day(triggered(ds="1998-03-01")) == "1998-03-01"
    assert run_day({"params": {}, "ds": "1998-03-02"}) == "1998-03-02"
    assert lake_override({"params": {}, "ds": "1998-03-02"}) is None


def test_the_run_reads_the_lake_of_its_event_unless_a_lake_is_given(tmp_path, monkeypatch):
    config = tmp_path / "pipeline.yaml"
    config.write_text(
        json.dumps(
            {
                "data": {
                    "lake_uri": "s3://configured/clicks",
                    "allowed_lakes": ["s3://validated/clicks", "/data/by-hand"],
                }
            }
        )
    )
    monkeypatch.setenv("CTR_PIPELINE_CONFIG", str(config))
    monkeypatch.delenv("CTR_LAKE_AWS_CONN_ID", raising=False)
    ctx = triggered(event(VALIDATED, {"day": "2024-01-08", "lake_uri": "s3://validated/clicks"}))
    assert pipeline_config(ctx).data.lake_uri == "s3://validated/clicks"
    ctx["params"] = {"lake_uri": "/data/by-hand"}
    assert pipeline_config(ctx).data.lake_uri == "/data/by-hand"
    assert pipeline_config({"params": {}, "ds": "2024-01-08"}).data.lake_uri == "s3://configured/clicks"
    # A lake outside the list, from a param or an event: refused before the task reads anything.
    for ctx in (
        {"params": {"lake_uri": "/etc"}},
        triggered(event(VALIDATED, {"day": "2024-01-08", "lake_uri": "s3://elsewhere/x"})),
    ):
        with pytest.raises(ConfigError, match="is not allowed"):
            pipeline_config(ctx)


def test_every_consumed_day_of_the_newest_lake_oldest_first():
    """The monitor's windows are days: a run that consumed several days scores each of them."""
    ctx = triggered(
        event(VALIDATED, {"day": "2024-01-08", "lake_uri": "s3://a/clicks"}, minutes=30),
        event(VALIDATED, {"day": "2024-01-06", "lake_uri": "s3://a/clicks"}, minutes=40),
        event(VALIDATED, {"day": "2024-01-07", "lake_uri": "s3://other/clicks"}, minutes=50),
        event(VALIDATED, {"day": "2024-01-06", "lake_uri": "s3://a/clicks"}, minutes=60),
    )
    assert run_days(ctx) == ["2024-01-06", "2024-01-08"]
    assert run_days({**ctx, "params": {"day": "2024-01-02"}}) == ["2024-01-02"]  # by hand: that day only
    assert run_days({"params": {}, "ds": "2024-01-09"}) == ["2024-01-09"]
