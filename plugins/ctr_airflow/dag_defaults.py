"""The `@dag` header every CTR DAG shares, written once.

A DAG file states what is its own (id, schedule, tags, params, concurrency) and `ctr_dag(...)` adds
the rest: the start date, no catchup, the owner, the `ctr` tag, the retries, the mapped instances' names
(`map_label`) and the file's docstring as the DAG's doc.

Retries, one rule for every task: a task retries (RETRIES times, with exponential backoff from
RETRY_DELAY up to MAX_RETRY_DELAY) unless its error is deterministic. Every CTR task touches S3 or
MLflow, where a timeout, a 503 or a restarting server is transient; a `pipelines` refusal (a
PipelineError: bad data, a gate rejection, a refused move, a bad config) gives the same answer on
every try, so `ctr_task` (the `@task` of every CTR DAG) turns it into `TaskRefused`, Airflow's
fail-without-retry exception, and the operators do the same (`ctr_airflow.operators`). Retrying is
safe: stages are idempotent (registration keys, op ids of alias moves, committed lake partitions). The form fields
that several DAGs ask for (a day, the
lake) are built by `day_param` / `lake_uri_param`. `REGISTRY_POOL` is the one-slot pool of every
registry write (registration, alias moves), named here and nowhere else in the code: `pipelines`
does not need it (its registry lock serialises alias moves across processes, Airflow or not);
`scripts/stack.py`, `docker-compose.yml` and tests/e2e create the pool under this name.

Import-light (DAG files import it at parse time): Airflow's SDK and pendulum only.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
from datetime import timedelta

import pendulum

# The class behind `@task` (Airflow's own, private name): subclassed only to carry the MLflow links.
from airflow.providers.standard.decorators.python import _PythonDecoratedOperator
from airflow.sdk import Param, dag
from airflow.sdk.bases.decorator import task_decorator_factory
from airflow.sdk.exceptions import AirflowFailException

from ctr_airflow.links import LINKS, find, remember

log = logging.getLogger(__name__)

OWNER = "ctr-ml"
TAG = "ctr"
# Early: backtests run on historical days (MovieLens is 1997-98).
START_DATE = pendulum.datetime(1997, 1, 1, tz="UTC")
RETRIES = 3
# 1, 2, 4 minutes (plus Airflow's jitter): long enough for a tracking server or an S3 endpoint to come back.
RETRY_DELAY = timedelta(minutes=1)
MAX_RETRY_DELAY = timedelta(minutes=30)
REGISTRY_POOL = "ctr_registry"
# The library's limit on a move's reason (pipelines.promotion.aliases.REASON_MAX_CHARS, which imports
# MLflow and cannot be read at parse time; tests/plugins/ctr_airflow/test_dag_defaults.py keeps them equal).
REASON_MIN_CHARS, REASON_MAX_CHARS = 5, 1000


class TaskRefused(AirflowFailException):
    """A deterministic refusal from `pipelines` (a PipelineError): the task fails without retrying."""


# A mapped task instance's name in the grid, its logs and Required actions: what it works on (map_label),
# rendered by Airflow when the instance runs. Unmapped tasks render it too and show nothing of it.
MAP_LABEL = "{{ map_label(task) }}"


def default_args(retries: int = RETRIES, retry_delay: timedelta = RETRY_DELAY) -> dict:
    """The tasks' defaults: retries with exponential backoff (see the module doc), mapped instances named."""
    return {
        "retries": retries,
        "retry_delay": retry_delay,
        "retry_exponential_backoff": 2.0,
        "max_retry_delay": MAX_RETRY_DELAY,
        "owner": OWNER,
        "map_index_template": MAP_LABEL,
    }


def map_label(task) -> str:
    """The ad slot a task instance works on (`slot`, or a `slot` inside its dict arguments: a candidate, an
    evaluation, a registered version), else the model it moves (`model`); "" where it has neither, and Airflow
    shows the index. Never raises: a label that failed to render would fail a task that succeeded."""
    try:
        args = getattr(task, "op_kwargs", None) or {n: getattr(task, n, None) for n in task.template_fields}
        return str(find(args, "slot") or find(args, "model") or "")
    except Exception:  # noqa: BLE001 (a name, never a failure)
        return ""


def worker_name(environ=os.environ) -> str:
    """The Celery worker running this task (its node name, e.g. ctr_stack-worker-1@host; set by
    ctr_airflow.celery_config when the worker starts), else this machine's host name."""
    return environ.get("CTR_CELERY_WORKER") or socket.gethostname()


def _announce() -> None:
    """Name the worker in the task log, and hand the map index to the MLflow runs the task opens
    (pipelines.registry.runs reads AIRFLOW_CTX_*; Airflow exports no map index of its own)."""
    from airflow.sdk import get_current_context

    try:
        map_index = int(getattr(get_current_context()["ti"], "map_index", -1))
    except Exception:  # noqa: BLE001 (outside a task instance: nothing to tell)
        map_index = -1
    if map_index >= 0:
        os.environ["AIRFLOW_CTX_MAP_INDEX"] = str(map_index)
    else:  # dag.test() runs every task in one process: not the previous task's index
        os.environ.pop("AIRFLOW_CTX_MAP_INDEX", None)
    log.info("running on worker %s (pid %d)", worker_name(), os.getpid())


def fail_fast(fn):
    """`fn`, with a PipelineError (deterministic) raised as TaskRefused: no retry; anything else (a
    network error, a 5xx after the library's own retries) propagates and Airflow retries the task.
    Marked with `ctr_fail_fast` so tests/dags/test_dag_integrity.py can check every task has it."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        from pipelines.errors import PipelineError

        _announce()
        try:
            return fn(*args, **kwargs)
        except PipelineError as exc:
            raise TaskRefused(f"{type(exc).__name__}: {exc}") from exc

    run.ctr_fail_fast = True
    return run


class CtrTaskOperator(_PythonDecoratedOperator):
    """`@task`, with extra links to the MLflow run and model version its result names (ctr_airflow.links)."""

    operator_extra_links = LINKS

    def execute(self, context):
        result = super().execute(context)
        remember(self, result)
        return result


def ctr_task(fn=None, **kwargs):
    """Airflow's `@task` (or `@task(**kwargs)`) over `fail_fast(fn)`, with the MLflow links: the task of every
    CTR DAG."""

    def decorate(f):
        return task_decorator_factory(python_callable=fail_fast(f), decorated_operator_class=CtrTaskOperator, **kwargs)

    return decorate(fn) if fn is not None else decorate


def day_param(description: str) -> Param:
    """A form field for a day (YYYY-MM-DD); unset means the DAG's own default day (see `runtime.run_day`)."""
    return Param(None, type=["null", "string"], format="date", description=description)


def lake_uri_param() -> Param:
    """A form field that points one run at another click-log lake (read by `runtime.pipeline_config`):
    one of the pipeline config's lakes (`data.lake_uri`, `data.allowed_lakes`, read when the DAG file
    is parsed), so any other lake is refused when the run is triggered, before a task runs. An
    unreadable config is an import error of the DAG, like an unreadable gate policy."""
    from pipelines.config import load_pipeline_config

    lakes = list(load_pipeline_config().data.lakes())
    return Param(
        None,
        type=["null", "string"],
        enum=[None, *lakes],
        description=f"Read another click-log lake, one of {lakes} (default: data.lake_uri of the pipeline config)",
    )


def reason_param(description: str) -> Param:
    """A form field for the reason of a move: required, 5 to REASON_MAX_CHARS characters (checked when
    the run is triggered, before any task; the library checks the same limit wherever a move comes from)."""
    return Param(type="string", minLength=REASON_MIN_CHARS, maxLength=REASON_MAX_CHARS, description=description)


def ctr_dag(
    dag_id: str,
    doc_md: str,
    *,
    schedule,
    tags: list[str],
    params: dict,
    retries: int = RETRIES,
    retry_delay: timedelta = RETRY_DELAY,
    **kwargs,
):
    """Airflow's `@dag(...)` decorator with the shared header; `kwargs` go to `@dag` as they are
    (e.g. `max_active_runs`, `render_template_as_native_obj`).

    catchup is always False: a missed day is run by hand with the DAG's day param, and catching up
    from START_DATE would run (and validate, train, release) decades of days in one go.
    """
    macros = {"map_label": map_label, **kwargs.pop("user_defined_macros", {})}
    return dag(
        dag_id=dag_id,
        schedule=schedule,
        start_date=START_DATE,
        catchup=False,
        doc_md=doc_md,
        tags=[TAG, *tags],
        default_args=default_args(retries, retry_delay),
        params=params,
        user_defined_macros=macros,
        **kwargs,
    )
