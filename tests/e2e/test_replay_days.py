"""The runbook's day-exact Airflow replay (`scripts/replay_days.py`), two MovieLens days through real DAG runs
(`airflow dags test`, metadata in PostgreSQL when reachable, the lake and artifacts in moto's S3): each day
is validated, then monitored with the morning's champions, then retrained, in that order."""

from __future__ import annotations

import subprocess
import sys

import mlflow
import pytest
from mlflow import MlflowClient

from pipelines.promotion.aliases import current
from pipelines.promotion.monitor import EXPERIMENT
from tests.e2e.stack import CANARY, HOLDOUT_JUDGED, REPO, movielens_stack

pytestmark = pytest.mark.slow

BASE_DAY, FIRST, LAST = "1998-02-28", "1998-03-01", "1998-03-02"
SLOTS = ("morning", "afternoon", "night")
DAGS = ("ctr_lake_arrival", "ctr_champion_monitor", "ctr_lora_retrain")


@pytest.fixture(scope="module")
def stack(tmp_path_factory, s3_endpoint):
    with movielens_stack(
        tmp_path_factory.mktemp("replay"), "e2e-replay-lake", LAST, paths=CANARY, **HOLDOUT_JUDGED
    ) as st:
        yield st


def test_two_days_are_validated_monitored_and_retrained_in_order(stack):
    stack.airflow("dags", "test", "ctr_base_model", BASE_DAY)
    proc = subprocess.run(
        [sys.executable, "scripts/replay_days.py", "--from", FIRST, "--to", LAST],
        env=stack.env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=2400,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    steps = [line for line in proc.stdout.splitlines() if line.startswith("replay ")]
    assert steps == [f"replay {day}: {dag}" for day in (FIRST, LAST) for dag in DAGS]

    for slot in SLOTS:
        name = f"ctr_lora_{slot}"
        v1, v2 = sorted(MlflowClient().search_model_versions(f"name = '{name}'"), key=lambda v: int(v.version))
        assert (v1.tags["data.last"], v2.tags["data.last"]) == (FIRST, LAST)
        assert v2.tags["eval.champion_version"] == "1"  # gated against the first day's champion
        assert current(name) == "1"
        assert current(name, "canary") == ("2" if v2.tags["gate.passed"] == "true" else None)
    # the second morning's monitor scored the champions the first evening released, before the second
    # retrain made any canary: a champion window for each slot, no canary window
    windows = mlflow.search_runs(experiment_names=[EXPERIMENT], filter_string=f"tags.day = '{LAST}'")
    assert sorted(zip(windows["tags.model"], windows["tags.alias"], windows["tags.version"])) == sorted(
        (f"ctr_lora_{slot}", "champion", "1") for slot in SLOTS
    )
