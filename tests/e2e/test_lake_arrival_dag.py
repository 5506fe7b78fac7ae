"""Data-aware scheduling through real Airflow runs (`airflow dags test`, metadata in PostgreSQL when
reachable, else SQLite; the lake in moto's S3):

- `ctr_lake_arrival` for a day the lake has: the sensor finds it, validate passes, and Airflow records
  a `ctr_lake_validated` event with the day and the lake (the daily DAGs are still paused: nothing
  is queued for them).
- for a day the lake does not have (a 3 s `wait_timeout_s`): the sensor is rescheduled through the
  metadata DB, then skipped; the run is *not* failed and there is no event (nothing downstream runs).
- unpausing the daily DAGs queues nothing; the next validated day (an older one) queues all three,
  and the run the scheduler creates for `ctr_lora_retrain` consumes both events, has no logical date,
  and validates the newest day in the lake named by the event, not the configured one.

Cheap on purpose: a small synthetic lake, no training (validation only)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace

import boto3
import pytest
import sqlalchemy as sa
import yaml

from pipelines.config import to_dict
from pipelines.data.lake import Lake
from pipelines.data.synthetic import write_days
from tests.e2e.stack import Stack, make_env, metadata_stores
from tests.pipelines.promotion.test_monitor import ROWS, SPEC, make_config

pytestmark = pytest.mark.slow

BUCKET = "e2e-arrival-lake"
OLDER, NEWEST, MISSING = "2024-01-03", "2024-01-04", "2024-01-05"
CONSUMERS = {"ctr_lora_retrain", "ctr_cold_start", "ctr_champion_monitor"}


@pytest.fixture(scope="module")
def lakes(tmp_path_factory, s3_endpoint):
    """The configured lake holds 2024-01-02..03; the lake the arrivals are run on (`lake_uri` param)
    holds 2024-01-02..04. A consumer that ignored the event's lake would not find 2024-01-04."""
    tmp = tmp_path_factory.mktemp("e2e-arrival")
    boto3.client("s3").create_bucket(Bucket=BUCKET)
    configured, arrivals = f"s3://{BUCKET}/clicks", f"s3://{BUCKET}/arrivals"
    write_days(Lake(configured), SPEC, "2024-01-02", 2, ROWS)
    write_days(Lake(arrivals), SPEC, "2024-01-02", 3, ROWS)
    config_path = tmp / "pipeline.yaml"
    cfg = make_config(configured)  # the arrivals' lake is allowed; any other is refused (test below)
    config_path.write_text(yaml.safe_dump(to_dict(replace(cfg, data=replace(cfg.data, allowed_lakes=(arrivals,))))))
    return tmp, config_path, configured, arrivals


@pytest.fixture(scope="module")
def stack(lakes):
    tmp, config_path, _, _ = lakes
    with metadata_stores(tmp) as (airflow_conn, mlflow_uri, kind):
        # DAGs are created paused (Airflow's default): the daily DAGs are unpaused by the third test.
        st = Stack(make_env(tmp, airflow_conn, mlflow_uri, config_path, f"s3://{BUCKET}/mlflow"), kind, tmp)
        st.init_airflow()
        yield st


def sql(stack, query: str, **params) -> list[tuple]:
    engine = sa.create_engine(stack.env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"])
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(sa.text(query), params)]
    finally:
        engine.dispose()


def validated_events(stack) -> list[dict]:
    rows = sql(
        stack,
        "SELECT e.extra, e.source_dag_id, e.source_task_id FROM asset_event e "
        "JOIN asset a ON a.id = e.asset_id WHERE a.name = 'ctr_lake_validated' ORDER BY e.id",
    )
    # JSON column: a dict from PostgreSQL, text from SQLite
    return [{**(json.loads(x) if isinstance(x, str) else x), "source": f"{d}.{t}"} for x, d, t in rows]


def queued(stack) -> set[str]:
    """The DAGs Airflow has queued a run for on the asset (the scheduler turns each into a run)."""
    return {
        d
        for (d,) in sql(
            stack,
            "SELECT q.target_dag_id FROM asset_dag_run_queue q JOIN asset a "
            "ON a.id = q.asset_id WHERE a.name = 'ctr_lake_validated'",
        )
    }


def latest_run(stack, dag_id: str) -> tuple[str, str]:
    (row,) = sql(stack, "SELECT run_id, state FROM dag_run WHERE dag_id = :d ORDER BY id DESC LIMIT 1", d=dag_id)
    return row


def test_an_arrived_day_is_validated_and_announced(stack, lakes):
    arrivals = lakes[3]
    proc = stack.airflow("dags", "test", "ctr_lake_arrival", NEWEST, "-c", json.dumps({"lake_uri": arrivals}))
    out = proc.stdout + proc.stderr
    assert re.search(rf"validation of {re.escape(arrivals)}, 1 partitions ending {NEWEST} \(.* rows\): PASSED", out)
    run_id, state = latest_run(stack, "ctr_lake_arrival")
    assert state == "success"
    states = dict(
        sql(
            stack,
            "SELECT task_id, state FROM task_instance WHERE dag_id = 'ctr_lake_arrival' AND run_id = :r",
            r=run_id,
        )
    )
    assert states == {"wait_for_partition": "success", "validate": "success"}
    assert validated_events(stack) == [{"day": NEWEST, "lake_uri": arrivals, "source": "ctr_lake_arrival.validate"}]
    assert queued(stack) == set()  # the daily DAGs are paused: Airflow queues nothing for them


def test_a_lake_outside_the_allowed_list_is_refused_before_any_task_runs(stack, lakes):
    before = sql(stack, "SELECT count(*) FROM task_instance WHERE dag_id = 'ctr_lake_arrival'")
    # a day of its own: `dags test` replaces an earlier run of the same logical date
    proc = stack.airflow(
        "dags",
        "test",
        "ctr_lake_arrival",
        "2024-01-09",
        "-c",
        json.dumps({"lake_uri": f"s3://{BUCKET}/not-listed"}),
        check=False,
    )
    assert proc.returncode != 0
    assert "lake_uri" in proc.stdout + proc.stderr and "is not one of" in proc.stdout + proc.stderr
    assert sql(stack, "SELECT count(*) FROM task_instance WHERE dag_id = 'ctr_lake_arrival'") == before


def test_a_day_that_never_arrives_is_skipped_not_failed(stack, lakes):
    arrivals = lakes[3]
    before = validated_events(stack)
    proc = stack.airflow(
        "dags",
        "test",
        "ctr_lake_arrival",
        MISSING,
        "-c",
        json.dumps({"lake_uri": arrivals, "wait_timeout_s": 3}),
        timeout=300,
    )
    assert proc.returncode == 0
    out = proc.stdout + proc.stderr
    assert f"dt={MISSING} is not committed in {arrivals} yet" in out and "timed out" in out
    run_id, state = latest_run(stack, "ctr_lake_arrival")
    assert state == "success"  # a late day is not a red run
    states = dict(
        sql(
            stack,
            "SELECT task_id, state FROM task_instance WHERE dag_id = 'ctr_lake_arrival' AND run_id = :r",
            r=run_id,
        )
    )
    assert states == {"wait_for_partition": "skipped", "validate": "skipped"}
    # It waited in reschedule mode (slot freed between pokes, recorded in the metadata DB), not in a loop.
    (n,) = sql(
        stack,
        "SELECT count(*) FROM task_reschedule r JOIN task_instance t ON t.id = r.ti_id "
        "WHERE t.dag_id = 'ctr_lake_arrival' AND t.run_id = :r",
        r=run_id,
    )[0]
    assert n >= 1
    assert validated_events(stack) == before, "a skipped day must not announce anything"


CREATE_ASSET_RUN = """
import sys
from sqlalchemy import select
from airflow.jobs.job import Job
from airflow.jobs.scheduler_job_runner import SchedulerJobRunner
from airflow.models.dag import DagModel
from airflow.models.dagrun import DagRun
from airflow.utils.session import create_session

dag_id = sys.argv[1]
with create_session() as session:
    models = session.scalars(select(DagModel).where(DagModel.dag_id == dag_id)).all()
    SchedulerJobRunner(job=Job())._create_dag_runs_asset_triggered(dag_models=models, session=session)
    session.flush()
    run = session.scalars(select(DagRun).where(DagRun.dag_id == dag_id, DagRun.run_type == "asset_triggered")).one()
    print("RUN", run.run_id, run.logical_date, len(run.consumed_asset_events))
"""


def test_unpaused_daily_dags_run_for_the_newest_validated_day_on_its_lake(stack, lakes):
    """Unpausing queues nothing; the next validated day queues all three daily DAGs. Then the
    scheduler's own step that turns the queue into a run (called in-process: the rest of the scheduler
    loop needs a worker and an api-server), and the run's first task."""
    arrivals = lakes[3]
    stack.airflow("dags", "unpause", "--treat-dag-id-as-regex", "-y", "^(" + "|".join(sorted(CONSUMERS)) + ")$")
    assert queued(stack) == set()  # unpausing starts nothing: no run for a day that is not there yet
    # An older day validated after the newer one (e.g. a late partition, triggered by hand): it queues
    # the daily DAGs; the retrain run consumes both events and is about the newest day.
    stack.airflow("dags", "test", "ctr_lake_arrival", OLDER, "-c", json.dumps({"lake_uri": arrivals}))
    assert [e["day"] for e in validated_events(stack)] == [NEWEST, OLDER]
    assert queued(stack) == CONSUMERS

    proc = subprocess.run(
        [sys.executable, "-c", CREATE_ASSET_RUN, "ctr_lora_retrain"],
        env=stack.env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, run_id, logical_date, consumed = next(
        line for line in proc.stdout.splitlines() if line.startswith("RUN ")
    ).split(" ")
    assert logical_date == "None" and int(consumed) == 2  # no logical date: the day comes from the events

    out = stack.airflow("tasks", "test", "ctr_lora_retrain", "validate", run_id)
    text = out.stdout + out.stderr
    assert re.search(
        rf"validation of {re.escape(arrivals)}, \d+ partitions ending {NEWEST} \(.* rows\): PASSED", text
    ), text[-3000:]
