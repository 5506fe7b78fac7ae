"""The shared `@dag` header (ctr_airflow.dag_defaults): what every DAG gets, what stays each DAG's own,
and the form fields several DAGs share. (Every file in dags/ uses it: tests/dags/test_dag_integrity.py.)"""
from __future__ import annotations

import datetime as dt

import pytest
from airflow.sdk import task
from airflow.sdk.definitions.param import ParamValidationError

from ctr_airflow.dag_defaults import (OWNER, REGISTRY_POOL, RETRY_DELAY, START_DATE, TAG, ctr_dag, day_param,
                                      default_args, lake_uri_param)


def build(**kwargs):
    """A one-task DAG through the shared header."""
    @ctr_dag("ctr_example", "### Example\n\nwhat this DAG does", **{"schedule": None, "tags": ["example"],
                                                                    "retries": 2, "params": {}, **kwargs})
    def ctr_example():
        @task
        def noop() -> None:
            return None

        noop()

    return ctr_example()


def test_the_shared_header():
    dag = build(params={"day": day_param("a day"), "lake_uri": lake_uri_param()})
    assert dag.dag_id == "ctr_example" and dag.doc_md.startswith("### Example")
    assert dag.start_date == START_DATE and START_DATE.year == 1997   # backtests run on MovieLens days
    assert dag.catchup is False and type(dag.timetable).__name__ == "NullTimetable"
    assert set(dag.tags) == {TAG, "example"}
    assert dag.default_args == {"retries": 2, "retry_delay": RETRY_DELAY, "owner": OWNER}
    assert dag.get_task("noop").retries == 2 and dag.get_task("noop").owner == OWNER
    assert list(dag.params) == ["day", "lake_uri"]
    assert dag.fileloc == __file__   # the caller's file, not the helper's: the DAG processor keys on it


def test_what_stays_each_dags_own():
    dag = build(schedule="0 2 * * *", retries=0, retry_delay=dt.timedelta(minutes=1), max_active_runs=3,
                render_template_as_native_obj=True)
    assert type(dag.timetable).__name__ == "CronTriggerTimetable"
    assert dag.default_args["retries"] == 0 and dag.default_args["retry_delay"] == dt.timedelta(minutes=1)
    assert dag.max_active_runs == 3 and dag.render_template_as_native_obj is True
    assert default_args(1) == {"retries": 1, "retry_delay": dt.timedelta(minutes=5), "owner": "ctr-ml"}


@pytest.mark.parametrize("value, ok", [(None, True), ("2024-01-05", True), ("yesterday", False), (20240105, False)])
def test_day_param(value, ok):
    param = day_param("the day")
    assert param.description == "the day" and param.value is None
    if ok:
        assert param.resolve(value) == value
    else:
        with pytest.raises(ParamValidationError):
            param.resolve(value)


@pytest.mark.parametrize("value, ok", [(None, True), ("s3://bucket/clicks", True), ("/data/lake", True),
                                       ("http://bucket/clicks", False), ("lake", False)])
def test_lake_uri_param(value, ok):
    param = lake_uri_param()
    if ok:
        assert param.resolve(value) == value
    else:
        with pytest.raises(ParamValidationError):
            param.resolve(value)


def test_each_dag_gets_its_own_param_objects():
    assert lake_uri_param() is not lake_uri_param() and day_param("x") is not day_param("x")


def test_the_pool_is_a_plain_name():
    assert REGISTRY_POOL == "ctr_registry"   # scripts/stack.py, docker-compose.yml and tests/e2e create it


@pytest.mark.parametrize("value, ok", [("12345", True), ("x" * 1000, True), ("x" * 1001, False), ("x" * 2000, False),
                                       ("four", False), (12345, False), (None, False)])
def test_reason_param_has_the_librarys_limits(value, ok):
    """The form refuses a reason the library would refuse (pipelines.promotion.aliases), before any task."""
    from ctr_airflow.dag_defaults import REASON_MAX_CHARS, reason_param
    from pipelines.promotion.aliases import REASON_MAX_CHARS as LIBRARY_MAX

    assert REASON_MAX_CHARS == LIBRARY_MAX
    if ok:
        assert reason_param("why").resolve(value) == value
    else:
        with pytest.raises(ParamValidationError):
            reason_param("why").resolve(value)
