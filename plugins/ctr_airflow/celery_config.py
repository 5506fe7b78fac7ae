"""Celery settings of the stack's workers: Airflow's defaults plus a preload of the task libraries.

Used as `AIRFLOW__CELERY__CELERY_CONFIG_OPTIONS=ctr_airflow.celery_config.CELERY_CONFIG` (make stack,
docker-compose.yml).

Why the preload: on Linux a Celery worker runs each task instance in a process forked from its pool
(Airflow's supervisor uses a bare `os.fork`), so every task used to import torch, peft, mlflow,
Great Expectations, pandas and scikit-learn again: most of a short task's wall time (numbers in
docs/benchmarks.md). Importing them once in the worker's main process, before Celery forks its
pool, hands every task process those modules already loaded (copy-on-write). Importing them starts
no thread (checked), so forking afterwards is safe; torch's thread pools are created lazily in the
task process. `CTR_WORKER_PRELOAD` lists the modules (comma-separated; empty turns it off).

The worker also exports its Celery node name (`--celery-hostname`, e.g. ctr_stack-worker-1@host) as
CTR_CELERY_WORKER, which every task process inherits: task logs and MLflow runs (`airflow.worker`) name the
worker that ran them, where the machine's host name is the same for every worker of a machine.
"""

from __future__ import annotations

import importlib
import logging
import os
import time

from airflow.providers.celery.executors.default_celery import DEFAULT_CELERY_CONFIG
from celery.signals import celeryd_after_setup, worker_init

log = logging.getLogger(__name__)

CELERY_CONFIG = DEFAULT_CELERY_CONFIG
PRELOAD_ENV = "CTR_WORKER_PRELOAD"
DEFAULT_PRELOAD = (
    "torch",
    "pandas",
    "pyarrow.parquet",
    "sklearn.metrics",
    "matplotlib.pyplot",
    "mlflow",
    "mlflow.pyfunc",
    "peft",
    "great_expectations",
)


def preload_modules(names: list[str] | tuple[str, ...]) -> dict[str, float]:
    """Import `names`; returns seconds per module. A module that fails to import is logged and skipped:
    the task that needs it will then fail with the real error, in its own log."""
    os.environ.setdefault("MPLBACKEND", "Agg")  # no display on a worker
    # before MLflow's import starts its telemetry client: mlflow is preloaded before pipelines sets this
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    took = {}
    for name in names:
        t0 = time.perf_counter()
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - a worker must start even if one library is broken
            log.warning("preload of %s failed: %s", name, exc)
            continue
        took[name] = time.perf_counter() - t0
    return took


WORKER_ENV = "CTR_CELERY_WORKER"


@celeryd_after_setup.connect
def _export_worker_name(sender=None, **_) -> None:
    if sender:  # the node name, before the pool forks
        os.environ[WORKER_ENV] = str(sender)


@worker_init.connect
def _preload_task_libraries(**_) -> None:
    raw = os.environ.get(PRELOAD_ENV)
    names = DEFAULT_PRELOAD if raw is None else tuple(n.strip() for n in raw.split(",") if n.strip())
    if names:
        took = preload_modules(names)
        log.info("preloaded %d task libraries in %.1f s: %s", len(took), sum(took.values()), ", ".join(took))
