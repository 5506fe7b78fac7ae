"""A stage's MLflow run knows the Airflow task instance it ran in (the `AIRFLOW_CTX_*` variables Airflow exports
to a task's process), ends FAILED with its error when the attempt fails, and a retry's run links to the
failed try's run. Real SQLite store (tests/pipelines/conftest.py: serving_store)."""

from __future__ import annotations

import mlflow
import pytest
from mlflow import MlflowClient

from pipelines.registry import mlflow_io, runs

TASK = {
    "AIRFLOW_CTX_DAG_ID": "ctr_lora_retrain",
    "AIRFLOW_CTX_DAG_RUN_ID": "manual__2026-12-06T10:00:00+00:00",
    "AIRFLOW_CTX_TASK_ID": "train_adapter",
    "AIRFLOW_CTX_MAP_INDEX": "2",
    "CTR_CELERY_WORKER": "ctr_stack-worker-1@vm",
}


@pytest.fixture
def in_task(monkeypatch, serving_store):
    def attempt(try_number: int, base_url: str | None = "http://airflow.example:8080/"):
        for k, v in {**TASK, "AIRFLOW_CTX_TRY_NUMBER": str(try_number)}.items():
            monkeypatch.setenv(k, v)
        if base_url:
            monkeypatch.setenv("AIRFLOW__API__BASE_URL", base_url)
        else:
            monkeypatch.delenv("AIRFLOW__API__BASE_URL", raising=False)

    return attempt


def test_a_run_opened_in_a_task_carries_the_task_instance_and_a_link_back(in_task):
    in_task(1)
    with runs.start_run(mlflow_io.ensure_experiment("ctr-test"), "ctr_lora_morning-1998-03-07") as run:
        pass
    tags = MlflowClient().get_run(run.info.run_id).data.tags
    assert {k: tags[k] for k in runs.AIRFLOW_ENV} == {
        "airflow.dag_id": "ctr_lora_retrain",
        "airflow.run_id": "manual__2026-12-06T10:00:00+00:00",
        "airflow.task_id": "train_adapter",
        "airflow.try_number": "1",
        "airflow.map_index": "2",
        "airflow.worker": "ctr_stack-worker-1@vm",
    }
    # the mapped instance's own page (Airflow's UI route for an index), not the task's list of indexes
    assert tags[runs.URL_TAG] == (
        "http://airflow.example:8080/dags/ctr_lora_retrain/runs/"
        "manual__2026-12-06T10%3A00%3A00%2B00%3A00/tasks/train_adapter/mapped/2"
    )
    assert runs.PREVIOUS_TRY_TAG not in tags and runs.ERROR_TAG not in tags


def test_an_unmapped_task_links_to_its_task_page(in_task, monkeypatch):
    in_task(1)
    monkeypatch.delenv("AIRFLOW_CTX_MAP_INDEX")
    assert runs.airflow_tags()[runs.URL_TAG].endswith("/tasks/train_adapter")


def test_without_the_api_servers_address_the_tags_stay_and_no_url_is_guessed(in_task):
    in_task(1, base_url=None)
    assert runs.URL_TAG not in runs.airflow_tags() and runs.airflow_tags()["airflow.task_id"] == "train_adapter"


def test_outside_airflow_a_run_has_no_airflow_tags(serving_store, monkeypatch):
    for var in runs.AIRFLOW_ENV.values():
        monkeypatch.delenv(var, raising=False)
    with runs.start_run(mlflow_io.ensure_experiment("ctr-test"), "base-1998-03-06") as run:
        pass
    assert not [k for k in MlflowClient().get_run(run.info.run_id).data.tags if k.startswith("airflow.")]


def test_a_failed_attempt_ends_its_run_failed_with_the_error_and_the_retry_links_to_it(in_task):
    exp = mlflow_io.ensure_experiment("ctr-test")
    in_task(1)
    with pytest.raises(KeyError):
        with runs.start_run(exp, "ctr_lora_morning-1998-03-07") as first:
            with runs.start_run(exp, "ctr_lora_afternoon-1998-03-07", nested=True):
                pass  # another slot's run of the same task: never taken for this slot's previous try
            raise KeyError("_MLFLOW_TELEMETRY_SESSION_ID")
    assert mlflow.active_run() is None
    failed = MlflowClient().get_run(first.info.run_id)
    assert failed.info.status == "FAILED"
    assert failed.data.tags[runs.ERROR_TAG] == "KeyError: '_MLFLOW_TELEMETRY_SESSION_ID'"

    in_task(2)
    with runs.start_run(exp, "ctr_lora_morning-1998-03-07") as retry:
        pass
    done = MlflowClient().get_run(retry.info.run_id)
    assert done.info.status == "FINISHED" and runs.ERROR_TAG not in done.data.tags
    assert done.data.tags[runs.PREVIOUS_TRY_TAG] == first.info.run_id
    assert done.data.tags["airflow.try_number"] == "2"


def test_a_retry_whose_first_try_left_no_run_links_nothing(in_task):
    in_task(3)
    with runs.start_run(mlflow_io.ensure_experiment("ctr-test"), "base-1998-03-06") as run:
        pass
    assert runs.PREVIOUS_TRY_TAG not in MlflowClient().get_run(run.info.run_id).data.tags
