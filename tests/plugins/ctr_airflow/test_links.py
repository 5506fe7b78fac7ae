"""Airflow's extra links to MLflow (ctr_airflow.links): a task's result names the run and the version it wrote,
and the links point at the MLflow UI's pages for them, or nowhere when there is no UI to point at."""

from __future__ import annotations

from airflow.sdk import BaseOperator, dag

from ctr_airflow.dag_defaults import CtrTaskOperator, ctr_task, worker_name
from ctr_airflow.links import LINKS, MlflowModelVersionLink, MlflowRunLink, remember, urls
from ctr_airflow.operators import GatedPromotionOperator, ReleaseOperator, RevertModelVersionOperator

SERVER = {"MLFLOW_TRACKING_URI": "http://mlflow.example:5000/"}


def test_a_registered_version_links_to_its_page_and_its_training_run():
    registered = {"model": "ctr_lora_morning", "version": "3", "candidate": {"run_id": "abc123", "slot": "morning"}}
    assert urls(registered, SERVER) == {
        "run": "http://mlflow.example:5000/#/runs/abc123",
        "version": "http://mlflow.example:5000/#/models/ctr_lora_morning/versions/3",
    }


def test_a_trained_candidate_links_to_its_run_only():
    assert urls({"model_name": "ctr_lora_night", "run_id": "r1"}, SERVER) == {
        "run": "http://mlflow.example:5000/#/runs/r1"
    }


def test_without_an_mlflow_ui_there_is_no_link():
    local = {"MLFLOW_TRACKING_URI": "sqlite:///mlflow.db"}
    assert urls({"model": "m", "version": "1", "run_id": "r"}, local) == {}
    ui = {**local, "CTR_MLFLOW_UI_URL": "https://mlflow.internal"}  # a UI in front of a database store
    assert urls({"model": "m", "version": "1"}, ui) == {"version": "https://mlflow.internal/#/models/m/versions/1"}
    assert urls(None, SERVER) == {} and urls(["not", "a", "dict"], SERVER) == {}


def test_names_are_quoted_into_the_url():
    assert urls({"model": "a b/c", "version": "2"}, SERVER)["version"].endswith("/#/models/a%20b%2Fc/versions/2")


def test_the_link_reads_what_the_operator_remembered_and_is_empty_before(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", SERVER["MLFLOW_TRACKING_URI"])
    op = BaseOperator(task_id="t")
    assert MlflowRunLink().get_link(op, ti_key=None) == ""
    remember(op, {"model": "m", "version": "4", "run_id": "r9"})
    assert MlflowRunLink().get_link(op, ti_key=None).endswith("/#/runs/r9")
    assert MlflowModelVersionLink().get_link(op, ti_key=None).endswith("/#/models/m/versions/4")


def test_every_ctr_task_and_registry_operator_carries_the_links():
    @dag(schedule=None)
    def example():
        @ctr_task
        def train(slot: str) -> dict:
            return {}

        @ctr_task(pool="p")
        def register() -> dict:
            return {}

        train.expand(slot=["morning", "night"])
        register()

    built = example()
    for task_id in ("train", "register"):  # mapped or not
        task = built.get_task(task_id)
        assert getattr(task, "operator_class", type(task)) is CtrTaskOperator  # a mapped task holds its class
        assert {link.name for link in task.operator_extra_links} == {"MLflow run", "MLflow model version"}
    assert built.get_task("register").pool == "p"
    for op in (GatedPromotionOperator, ReleaseOperator, RevertModelVersionOperator):
        assert op.operator_extra_links == LINKS


def test_a_task_names_its_celery_worker_else_its_host():
    assert worker_name({"CTR_CELERY_WORKER": "ctr_stack-worker-2@vm"}) == "ctr_stack-worker-2@vm"
    assert worker_name({}) != ""
