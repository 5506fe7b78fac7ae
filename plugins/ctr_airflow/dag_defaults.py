"""The `@dag` header every CTR DAG shares, written once.

A DAG file states what is its own (id, schedule, tags, retries, params, concurrency) and
`ctr_dag(...)` adds the rest: the start date, no catchup, the owner, the `ctr` tag, the retry delay
and the file's docstring as the DAG's doc. The form fields that several DAGs ask for (a day, the
lake) are built by `day_param` / `lake_uri_param`. `REGISTRY_POOL` is the one-slot pool of every
registry write (registration, alias moves), named here and nowhere else in the code: `pipelines`
does not need it (its registry lock serialises alias moves across processes, Airflow or not);
`scripts/stack.py`, `docker-compose.yml` and tests/e2e create the pool under this name.

Import-light (DAG files import it at parse time): Airflow's SDK and pendulum only.
"""
from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import Param, dag

OWNER = "ctr-ml"
TAG = "ctr"
# Early: backtests run on historical days (MovieLens is 1997-98).
START_DATE = pendulum.datetime(1997, 1, 1, tz="UTC")
RETRY_DELAY = timedelta(minutes=5)
REGISTRY_POOL = "ctr_registry"
LAKE_URI_PATTERN = "^(s3://|/).+"
# The library's limit on a move's reason (pipelines.promotion.aliases.REASON_MAX_CHARS, which imports
# MLflow and cannot be read at parse time; tests/plugins/ctr_airflow/test_dag_defaults.py keeps them equal).
REASON_MIN_CHARS, REASON_MAX_CHARS = 5, 1000


def default_args(retries: int, retry_delay: timedelta = RETRY_DELAY) -> dict:
    """The tasks' defaults: `retries` is each DAG's own choice (a task may still set its own)."""
    return {"retries": retries, "retry_delay": retry_delay, "owner": OWNER}


def day_param(description: str) -> Param:
    """A form field for a day (YYYY-MM-DD); unset means the DAG's own default day (see `runtime.run_day`)."""
    return Param(None, type=["null", "string"], format="date", description=description)


def lake_uri_param() -> Param:
    """A form field that points one run at another click-log lake (read by `runtime.pipeline_config`)."""
    return Param(None, type=["null", "string"], pattern=LAKE_URI_PATTERN,
                 description="Override the click-log lake (default: configs/pipeline.yaml)")


def reason_param(description: str) -> Param:
    """A form field for the reason of a move: required, 5 to REASON_MAX_CHARS characters (checked when
    the run is triggered, before any task; the library checks the same limit wherever a move comes from)."""
    return Param(type="string", minLength=REASON_MIN_CHARS, maxLength=REASON_MAX_CHARS, description=description)


def ctr_dag(dag_id: str, doc_md: str, *, schedule, tags: list[str], retries: int, params: dict,
            retry_delay: timedelta = RETRY_DELAY, **kwargs):
    """Airflow's `@dag(...)` decorator with the shared header; `kwargs` go to `@dag` as they are
    (e.g. `max_active_runs`, `render_template_as_native_obj`).

    catchup is always False: a missed day is run by hand with the DAG's day param, and catching up
    from START_DATE would run (and validate, train, release) decades of days in one go.
    """
    return dag(dag_id=dag_id, schedule=schedule, start_date=START_DATE, catchup=False, doc_md=doc_md,
               tags=[TAG, *tags], default_args=default_args(retries, retry_delay), params=params, **kwargs)
