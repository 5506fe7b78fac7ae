"""The Celery settings module the stack's workers load: importable as Airflow imports it, Airflow's
defaults untouched, and a preload that survives a broken library."""

from __future__ import annotations

import importlib
import logging
import os
import sys

from airflow.providers.celery.executors.default_celery import DEFAULT_CELERY_CONFIG

from ctr_airflow import celery_config
from ctr_airflow.celery_config import preload_modules


def test_config_is_airflows_default_and_importable_by_dotted_path():
    mod = importlib.import_module("ctr_airflow.celery_config")
    assert mod.CELERY_CONFIG is DEFAULT_CELERY_CONFIG
    assert "broker_url" in mod.CELERY_CONFIG


def test_preload_imports_what_it_can_and_logs_what_it_cannot(caplog, monkeypatch):
    monkeypatch.delitem(sys.modules, "colorsys", raising=False)
    with caplog.at_level(logging.WARNING, logger="ctr_airflow.celery_config"):
        took = preload_modules(["colorsys", "no_such_module_for_ctr_tests"])
    assert list(took) == ["colorsys"] and "colorsys" in sys.modules
    assert any("no_such_module_for_ctr_tests" in r.getMessage() for r in caplog.records)


def test_empty_preload_list_turns_it_off(monkeypatch):
    monkeypatch.setenv(celery_config.PRELOAD_ENV, "")
    monkeypatch.delitem(sys.modules, "colorsys", raising=False)
    monkeypatch.setattr(celery_config, "DEFAULT_PRELOAD", ("colorsys",))
    celery_config._preload_task_libraries()
    assert "colorsys" not in sys.modules


def test_the_preload_turns_mlflow_telemetry_off_before_it_imports_mlflow(monkeypatch):
    """MLflow starts its telemetry client when imported, and the preload imports it before pipelines
    (whose import turns telemetry off) is ever imported in the worker."""
    monkeypatch.delenv("MLFLOW_DISABLE_TELEMETRY", raising=False)
    preload_modules([])
    assert os.environ["MLFLOW_DISABLE_TELEMETRY"] == "true"
