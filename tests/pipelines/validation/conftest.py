"""Fixtures of the validation-stage tests on a lake (the bad-input corpus, no false alarms): the healthy
window validated once, the run day's healthy rows, a private copy of the window per test, and a store
whose registry holds ctr_lora_feed v1 @champion (validation must leave it alone).

`lake` here is that copy of the validated window (it overrides tests/pipelines/conftest.py's `lake`
for this folder). The package-scoped fixtures are built once for the folder and never written to:
the tests work on copies.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import mlflow
import pandas as pd
import pytest
from mlflow import MlflowClient

from pipelines.data.lake import Lake
from pipelines.data.synthetic import write_days
from pipelines.promotion import aliases
from pipelines.registry.mlflow_scope import temporary_mlflow
from pipelines.validation.stage import read_marker, validate_window
from tests.conftest import adapter_tags, use_store_copy
from tests.pipelines.validation.healthy_window import (
    DAY,
    FIRST,
    HEALTHY,
    MODEL,
    REF_DAYS,
    ROWS,
    SPEC,
    config,
    registry_state,
    synthetic,
)


@pytest.fixture(scope="package")
def template_lake(tmp_path_factory) -> Path:
    """The healthy window, generated (2 part files a day) and validated once: every day "passed"."""
    root = tmp_path_factory.mktemp("lake-template") / "lake"
    write_days(Lake(str(root)), SPEC, FIRST, REF_DAYS, ROWS, chunk_rows=ROWS // 2)
    summary = validate_window(config(str(root)), str(root), HEALTHY[-1], REF_DAYS)
    assert summary["success"] and summary["partitions"] == REF_DAYS and summary["rows"] == REF_DAYS * ROWS
    for d in HEALTHY:
        assert read_marker(Lake(str(root)), d)["status"] == "passed"
    return root


@pytest.fixture(scope="package")
def healthy_next_day() -> pd.DataFrame:
    """The run day's rows as the generator makes them (each corruption starts from a copy)."""
    return synthetic(DAY)


@pytest.fixture
def lake(template_lake, tmp_path) -> Path:
    """A private copy of the validated window (copy2 keeps the markers' mtimes)."""
    root = tmp_path / "lake"
    shutil.copytree(template_lake, root)
    return root


@pytest.fixture(scope="package")
def champion_db(tmp_path_factory) -> Path:
    """An MLflow SQLite store holding ctr_lora_feed v1 (gate passed) promoted to @champion."""
    d = tmp_path_factory.mktemp("mlflow-template")
    uri = f"sqlite:///{d / 'mlflow.db'}"
    # cwd d: the promotion-history experiment's default artifact root lands there
    with contextlib.chdir(d), temporary_mlflow(uri):
        c = MlflowClient()
        c.create_registered_model(MODEL)
        v = c.create_model_version(MODEL, source="file:///tmp/x", tags=adapter_tags(**{"gate.passed": "true"})).version
        assert str(v) == "1"
        aliases.promote(MODEL, "1", reason="initial champion", actor="test")
    return d / "mlflow.db"


@pytest.fixture
def registry(champion_db, tmp_path, monkeypatch):
    """A fresh copy of the store per test, as the tracking + registry server of the run."""
    uri = use_store_copy(champion_db, tmp_path, monkeypatch)
    assert registry_state() == (["1"], "1", 1)
    yield uri
    mlflow.set_tracking_uri(None)
