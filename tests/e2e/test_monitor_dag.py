"""`ctr_champion_monitor` through real Airflow DAG runs (`airflow dags test`) over three successive days, on a
synthetic lake in moto's S3, with PostgreSQL metadata stores when reachable (else SQLite).

Set-up in-process (faster than running the other DAGs): the serving base and two `ctr_lora_feed`
versions (v1 trained up to 2024-01-04, v2 up to 2024-01-05); v1 serves, v2 is the canary. The third
day's feed clicks go to the rows v2 ranks lowest (the slot's click rate is kept: validation passes it).

Day 1: the canary waits (1 of 2 healthy windows), nothing is reverted (no mapped revert task).
Day 2: the canary is promoted. Day 3: the new champion collapses => auto_revert puts v1 back.
Day 4: a bad canary (v3, trained on flipped labels) is started next to v1 => the monitor withdraws it.
"""

from __future__ import annotations

import os
from dataclasses import replace

import mlflow
import pytest

from pipelines.data.lake import Lake
from pipelines.data.synthetic import write_days
from pipelines.promotion import aliases
from pipelines.promotion.aliases import current, history
from pipelines.promotion.monitor import EXPERIMENT, load_windows
from tests.e2e.stack import REPO, synthetic_stack
from tests.pipelines.promotion.test_monitor import (
    MODEL,
    POLICY,
    ROWS,
    SPEC,
    degrade,
    make_config,
    register_adapter,
    start,
    validate,
    write_lake,
)

BUCKET = "e2e-monitor-lake"
DAYS = ("2024-01-06", "2024-01-07", "2024-01-08", "2024-01-09")
E2E_POLICY = replace(POLICY, revert_windows=1)  # one collapsed window is enough here (K is unit-tested)


@pytest.fixture(scope="module")
def dagbag(tmp_path_factory):
    os.environ.setdefault("AIRFLOW_HOME", str(tmp_path_factory.mktemp("airflow_home")))
    os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
    from airflow.dag_processing.dagbag import DagBag  # noqa: PLC0415 Airflow reads AIRFLOW_HOME, set above, on import

    return DagBag(dag_folder=str(REPO / "dags"))


def test_monitor_dag_shape(dagbag):
    dag = dagbag.dags["ctr_champion_monitor"]
    assert dag.catchup is False and dag.max_active_runs == 1 and set(dag.tags) == {"ctr", "monitor", "registry"}
    assert set(dag.params) == {"day", "lake_uri"} and "retries" in dag.default_args and len(dag.doc_md) > 200
    for up, down in (
        ("validate", "monitor"),
        ("monitor", "reverts_due"),
        ("reverts_due", "auto_revert"),
        ("monitor", "check"),
    ):
        assert down in dag.get_task(up).downstream_task_ids, f"{up} -> {down} missing"
    # bad data and unmonitorable models are PipelineErrors: failed at once (ctr_task), S3 / MLflow faults retried
    for task_id in ("validate", "check"):
        t = dag.get_task(task_id)
        assert t.python_callable.ctr_fail_fast and t.retries >= 2
    assert type(dag.get_task("auto_revert")).__name__ == "MappedOperator"
    # canary moves and reverts are registry writes: the one-slot pool every registry writer uses
    assert dag.get_task("monitor").pool == dag.get_task("auto_revert").pool == "ctr_registry"


@pytest.fixture(scope="module")
def stack(tmp_path_factory, s3_endpoint):
    with synthetic_stack(tmp_path_factory.mktemp("e2e-monitor"), BUCKET, E2E_POLICY) as (st, cfg, lake):
        validate(cfg, lake, "2024-01-05", days=4)  # the adapters' windows, as a DAG would
        assert (register_adapter(cfg, lake, "2024-01-04"), register_adapter(cfg, lake, "2024-01-05")) == ("1", "2")
        flipped = write_lake(f"s3://{BUCKET}/flipped", flip_labels=True)
        validate(make_config(flipped), flipped, "2024-01-05", days=4)
        assert register_adapter(cfg, flipped, "2024-01-05") == "3"  # learns the opposite ranking
        write_days(Lake(lake), SPEC, DAYS[3], 1, ROWS)  # a fourth, ordinary day
        start(MODEL, "1", canary="2")
        degrade(lake, [DAYS[2]], MODEL, "2")
        yield st


@pytest.mark.slow
def test_four_days_wait_promote_auto_revert_then_withdraw(stack):
    out = stack.airflow("dags", "test", "ctr_champion_monitor", DAYS[0]).stdout
    assert "1/2 healthy windows of canary v2 vs champion v1" in out
    assert (current(MODEL), current(MODEL, "canary")) == ("1", "2")

    stack.airflow("dags", "test", "ctr_champion_monitor", DAYS[1])
    assert (current(MODEL), current(MODEL, "canary")) == ("2", None)
    promote = [h for h in history(MODEL) if h["kind"] == "promote"][-1]
    assert promote["to_version"] == "2" and "ctr_champion_monitor" in promote["actor"]
    assert f"dt={DAYS[0]}" in promote["reason"] and f"dt={DAYS[1]}" in promote["reason"]

    proc = stack.airflow("dags", "test", "ctr_champion_monitor", DAYS[2])
    assert current(MODEL) == "1", (proc.stdout + proc.stderr)[-4000:]
    revert = history(MODEL)[-1]
    assert (revert["kind"], revert["from_version"], revert["to_version"]) == ("revert", "2", "1")
    assert "airflow:ctr_champion_monitor/" in revert["actor"]  # the revert operator, in this DAG run
    assert revert["reason"].startswith("auto-revert by the monitor: champion v2 auc below")
    assert f"dt={DAYS[2]}" in revert["reason"]

    aliases.start_canary(MODEL, "3", 0.1, reason="e2e: a canary that ranks backwards", actor="e2e")
    proc = stack.airflow("dags", "test", "ctr_champion_monitor", DAYS[3])
    assert (current(MODEL), current(MODEL, "canary")) == ("1", None), (proc.stdout + proc.stderr)[-4000:]
    withdraw = history(MODEL, "canary")[-1]
    assert (withdraw["kind"], withdraw["from_version"]) == ("withdraw", "3") and "monitor" in withdraw["reason"]
    assert history(MODEL)[-1]["kind"] == "revert"  # the champion did not move on day 4

    # one window per version and day, in the ctr-monitor experiment; each day validated first
    assert [(w.alias, w.version, w.day) for w in load_windows(MODEL)] == [
        ("champion", "1", DAYS[0]),
        ("canary", "2", DAYS[0]),
        ("champion", "1", DAYS[1]),
        ("canary", "2", DAYS[1]),
        ("champion", "2", DAYS[2]),
        ("champion", "1", DAYS[3]),
        ("canary", "3", DAYS[3]),
    ]
    assert mlflow.get_experiment_by_name(EXPERIMENT) is not None
    runs = mlflow.search_runs(experiment_names=["ctr-data-validation"], output_format="list")
    assert sorted((r.data.tags["end_day"], r.data.tags["success"]) for r in runs) == [(d, "True") for d in DAYS]
