"""Every MLflow run a pipeline stage opens: tagged with the Airflow task instance it ran in, marked FAILED with
its error when the attempt fails, and linked to the run of the same task's previous try.

Airflow exports the task instance to the task's process as `AIRFLOW_CTX_*` variables before it runs
(`airflow.sdk.execution_time.context.context_to_airflow_vars`), so this reads them without importing Airflow:
pipelines stays plain Python, and outside Airflow (the CLI, the backtest) a run simply has no `airflow.*` tags.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from urllib.parse import quote

import mlflow

log = logging.getLogger(__name__)

# AIRFLOW_CTX_MAP_INDEX (a mapped instance's index) and CTR_CELERY_WORKER (the Celery node that ran it) are set
# by the CTR tasks themselves (ctr_airflow.dag_defaults, ctr_airflow.celery_config): Airflow exports neither.
AIRFLOW_ENV = {
    "airflow.dag_id": "AIRFLOW_CTX_DAG_ID",
    "airflow.run_id": "AIRFLOW_CTX_DAG_RUN_ID",
    "airflow.task_id": "AIRFLOW_CTX_TASK_ID",
    "airflow.try_number": "AIRFLOW_CTX_TRY_NUMBER",
    "airflow.map_index": "AIRFLOW_CTX_MAP_INDEX",
    "airflow.worker": "CTR_CELERY_WORKER",
}
URL_TAG = "airflow.url"
ERROR_TAG = "error"
PREVIOUS_TRY_TAG = "airflow.previous_try_run_id"
_ERROR_CHARS = 4000  # well inside MLflow's tag value limit; the task log has the traceback


def airflow_tags(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The `airflow.*` tags of the task instance this process runs (none outside Airflow), with a URL back to
    it in Airflow's UI when the API server's address is known (`AIRFLOW__API__BASE_URL`)."""
    tags = {tag: environ[var] for tag, var in AIRFLOW_ENV.items() if environ.get(var)}
    base = environ.get("AIRFLOW__API__BASE_URL", "").rstrip("/")
    if base and {"airflow.dag_id", "airflow.run_id", "airflow.task_id"} <= tags.keys():
        tags[URL_TAG] = (
            f"{base}/dags/{quote(tags['airflow.dag_id'], safe='')}/runs/"
            f"{quote(tags['airflow.run_id'], safe='')}/tasks/{quote(tags['airflow.task_id'], safe='')}"
            + (f"/mapped/{quote(tags['airflow.map_index'], safe='')}" if "airflow.map_index" in tags else "")
        )
    return tags


@contextlib.contextmanager
def start_run(experiment_id: str, run_name: str, nested: bool = False) -> Iterator:
    """`mlflow.start_run` for a stage: the task instance's tags, the previous try's run (when this is a retry),
    and on an exception the run ends FAILED (MLflow's own exit) with the error in the `error` tag. Not
    `set_experiment`: it exports MLFLOW_EXPERIMENT_ID to every later run of the process."""
    tags = airflow_tags()
    previous = _previous_try(experiment_id, run_name, tags)
    if previous:
        tags[PREVIOUS_TRY_TAG] = previous
    with mlflow.start_run(experiment_id=experiment_id, run_name=run_name, nested=nested, tags=tags) as run:
        try:
            yield run
        except Exception as e:
            mlflow.set_tag(ERROR_TAG, f"{type(e).__name__}: {e}"[:_ERROR_CHARS])
            raise


def _previous_try(experiment_id: str, run_name: str, tags: dict[str, str]) -> str | None:
    """The run of this task instance's previous try with the same name (a mapped task's slots differ by name),
    or None: on a first try, outside Airflow, or when none was recorded (the try failed before its run)."""
    try:
        attempt = int(tags.get("airflow.try_number", "1"))
    except ValueError:
        return None
    wanted = {k: tags.get(k) for k in ("airflow.dag_id", "airflow.run_id", "airflow.task_id")}
    if attempt < 2 or not all(wanted.values()):
        return None
    wanted["airflow.try_number"] = str(attempt - 1)
    if any("'" in v for v in [*wanted.values(), run_name]):
        return None  # not expressible in MLflow's filter syntax; the tags still tell the tries apart

    where = " and ".join([*(f"tags.`{k}` = '{v}'" for k, v in wanted.items()), f"attributes.run_name = '{run_name}'"])
    found = mlflow.search_runs(
        [experiment_id],
        filter_string=where,
        max_results=1,
        output_format="list",
        order_by=["attributes.start_time DESC"],
    )
    return found[0].info.run_id if found else None
