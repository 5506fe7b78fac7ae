"""The shared `@dag` header (ctr_airflow.dag_defaults): what every DAG gets, what stays each DAG's own,
and the form fields several DAGs share. (Every file in dags/ uses it: tests/dags/test_dag_integrity.py.)"""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from airflow.sdk import task
from airflow.sdk.definitions.param import ParamValidationError

from ctr_airflow.dag_defaults import (
    MAP_LABEL,
    MAX_RETRY_DELAY,
    OWNER,
    REASON_MAX_CHARS,
    REGISTRY_POOL,
    RETRIES,
    RETRY_DELAY,
    START_DATE,
    TAG,
    TaskRefused,
    ctr_dag,
    ctr_task,
    day_param,
    default_args,
    fail_fast,
    lake_uri_param,
    map_label,
    reason_param,
)
from ctr_airflow.operators import RevertModelVersionOperator
from pipelines.config import load_pipeline_config
from pipelines.errors import ConfigError, DataValidationError, PromotionError
from pipelines.promotion.aliases import REASON_MAX_CHARS as LIBRARY_MAX


def build(**kwargs):
    """A one-task DAG through the shared header."""

    @ctr_dag(
        "ctr_example",
        "### Example\n\nwhat this DAG does",
        **{"schedule": None, "tags": ["example"], "retries": 2, "params": {}, **kwargs},
    )
    def ctr_example():
        @task
        def noop() -> None:
            return None

        noop()

    return ctr_example()


def test_the_shared_header():
    dag = build(params={"day": day_param("a day"), "lake_uri": lake_uri_param()})
    assert dag.dag_id == "ctr_example" and dag.doc_md.startswith("### Example")
    assert dag.start_date == START_DATE and START_DATE.year == 1997  # backtests run on MovieLens days
    assert dag.catchup is False and type(dag.timetable).__name__ == "NullTimetable"
    assert set(dag.tags) == {TAG, "example"}
    assert dag.default_args == {
        "retries": 2,
        "retry_delay": RETRY_DELAY,
        "owner": OWNER,
        "retry_exponential_backoff": 2.0,
        "max_retry_delay": MAX_RETRY_DELAY,
        "map_index_template": MAP_LABEL,
    }
    assert dag.get_task("noop").map_index_template == MAP_LABEL and dag.user_defined_macros["map_label"] is map_label
    assert dag.get_task("noop").retries == 2 and dag.get_task("noop").owner == OWNER
    assert list(dag.params) == ["day", "lake_uri"]
    assert dag.fileloc == __file__  # the caller's file, not the helper's: the DAG processor keys on it


def test_what_stays_each_dags_own():
    dag = build(
        schedule="0 2 * * *",
        retries=0,
        retry_delay=dt.timedelta(minutes=1),
        max_active_runs=3,
        render_template_as_native_obj=True,
    )
    assert type(dag.timetable).__name__ == "CronTriggerTimetable"
    assert dag.default_args["retries"] == 0 and dag.default_args["retry_delay"] == dt.timedelta(minutes=1)
    assert dag.max_active_runs == 3 and dag.render_template_as_native_obj is True
    assert default_args(1)["retries"] == 1 and default_args()["retries"] == RETRIES >= 2
    assert default_args()["retry_exponential_backoff"] > 1  # 1, 2, 4 minutes: a server restart fits


@pytest.mark.parametrize("value, ok", [(None, True), ("2024-01-05", True), ("yesterday", False), (20240105, False)])
def test_day_param(value, ok):
    param = day_param("the day")
    assert param.description == "the day" and param.value is None
    if ok:
        assert param.resolve(value) == value
    else:
        with pytest.raises(ParamValidationError):
            param.resolve(value)


@pytest.fixture
def two_lakes(tmp_path, monkeypatch):
    """A pipeline config whose lake is s3://ctr-lake/clicks and which allows one other lake."""
    config = tmp_path / "pipeline.yaml"
    config.write_text("data:\n  lake_uri: s3://ctr-lake/clicks\n  allowed_lakes: [/data/lake]\n")
    monkeypatch.setenv("CTR_PIPELINE_CONFIG", str(config))


@pytest.mark.parametrize(
    "value, ok",
    [
        (None, True),
        ("s3://ctr-lake/clicks", True),
        ("/data/lake", True),
        ("s3://someone-elses-bucket/clicks", False),
        ("/etc", False),
        ("http://bucket/clicks", False),
        ("lake", False),
    ],
)
def test_lake_uri_param_takes_only_the_configs_lakes(two_lakes, value, ok):
    """Checked when the run is triggered, before any task: the form's enum is the config's lakes."""
    param = lake_uri_param()
    if ok:
        assert param.resolve(value) == value
    else:
        with pytest.raises(ParamValidationError):
            param.resolve(value)


def test_a_lake_outside_the_list_is_refused_by_the_library_too(two_lakes):
    """A run triggered by an event naming another lake never gets past pipeline_config."""
    data = load_pipeline_config().data
    assert data.checked_lake(None) == "s3://ctr-lake/clicks" and data.checked_lake("/data/lake/") == "/data/lake"
    with pytest.raises(ConfigError, match="lake 's3://other/clicks' is not allowed.*data.allowed_lakes"):
        data.checked_lake("s3://other/clicks")


def test_the_lake_param_refuses_an_invalid_pipeline_config(tmp_path, monkeypatch):
    (tmp_path / "pipeline.yaml").write_text("data:\n  allowed_lakes: [http://x]\n")
    monkeypatch.setenv("CTR_PIPELINE_CONFIG", str(tmp_path / "pipeline.yaml"))
    with pytest.raises(ConfigError, match="allowed_lakes"):
        lake_uri_param()


@pytest.mark.parametrize(
    "error",
    [
        DataValidationError("day 2024-01-02", [{"check": "rows", "observed": 0}]),
        PromotionError("v3 never passed its gate"),
    ],
)
def test_a_pipeline_refusal_fails_without_retry(error):
    def stage():
        raise error

    with pytest.raises(TaskRefused, match=type(error).__name__) as refused:
        fail_fast(stage)()
    assert refused.value.__cause__ is error


def test_a_transient_error_is_left_for_airflow_to_retry():
    def stage(x, **context):
        raise ConnectionResetError(f"S3 went away at {x}")

    with pytest.raises(ConnectionResetError):
        fail_fast(stage)(1)
    assert fail_fast(stage).__wrapped__ is stage  # Airflow reads the signature (context kwargs) through it


def test_ctr_task_is_airflows_task_over_fail_fast():
    @ctr_dag("ctr_example2", "### Example", schedule=None, tags=[], params={})
    def example():
        @ctr_task
        def plain() -> int:
            return 1

        @ctr_task(pool="p", retries=5)
        def with_args() -> int:
            return 2

        plain() >> with_args()

    dag = example()
    plain, with_args = dag.get_task("plain"), dag.get_task("with_args")
    assert plain.python_callable.ctr_fail_fast and with_args.python_callable.ctr_fail_fast
    assert plain.retries == RETRIES and with_args.retries == 5 and with_args.pool == "p"


def test_each_dag_gets_its_own_param_objects():
    assert lake_uri_param() is not lake_uri_param() and day_param("x") is not day_param("x")


@pytest.mark.parametrize(
    "setup",
    ["docker-compose.yml", "scripts/stack.py", "scripts/demo.sh", "scripts/bench_stack.py", "tests/e2e/stack.py"],
)
def test_every_stack_set_up_creates_the_pool_the_registry_writes_wait_in(setup):
    text = (Path(__file__).parents[3] / setup).read_text()
    created = re.findall(r"""pools["', ]+set["', ]+(\w+)""", text)  # `airflow pools set NAME` in shell or argv form
    assert created == [REGISTRY_POOL], created  # a task in a pool that does not exist is never scheduled


@pytest.mark.parametrize(
    "value, ok",
    [
        ("12345", True),
        ("x" * 1000, True),
        ("x" * 1001, False),
        ("x" * 2000, False),
        ("four", False),
        (12345, False),
        (None, False),
    ],
)
def test_reason_param_has_the_librarys_limits(value, ok):
    """The form refuses a reason the library would refuse (pipelines.promotion.aliases), before any task."""
    assert REASON_MAX_CHARS == LIBRARY_MAX
    if ok:
        assert reason_param("why").resolve(value) == value
    else:
        with pytest.raises(ParamValidationError):
            reason_param("why").resolve(value)


def test_a_mapped_instance_is_named_by_its_slot_or_by_the_model_it_moves():
    """The label Airflow shows for a mapped instance (grid, logs, Required actions) instead of its index."""

    def taskflow(**op_kwargs):
        return SimpleNamespace(op_kwargs=op_kwargs, template_fields=("op_args", "op_kwargs"))

    assert map_label(taskflow(slot="morning")) == "morning"  # train_adapter
    assert map_label(taskflow(candidate={"model": "ctr_lora_night", "slot": "night"})) == "night"  # evaluate
    assert map_label(taskflow(evaluated={"candidate": {"slot": "feed"}, "evaluation": {}})) == "feed"  # register
    revert = RevertModelVersionOperator(task_id="auto_revert", model="ctr_lora_feed", reason="monitor: AUC fell")
    assert map_label(revert) == "ctr_lora_feed"


def test_a_task_with_nothing_to_name_it_by_gets_no_label_and_never_an_error():
    class Broken:
        template_fields = ("registered",)

        @property
        def registered(self):
            raise RuntimeError("not resolved")

    assert map_label(SimpleNamespace(op_kwargs={"report": {"rows": 3}}, template_fields=())) == ""
    assert map_label(Broken()) == ""
