"""Fixtures shared by the stage tests: a small synthetic lake and a fresh store with a serving base."""

from __future__ import annotations

import mlflow
import pytest

from pipelines.data.lake import Lake
from pipelines.data.synthetic import write_days
from pipelines.training import checkpoint
from tests.conftest import use_store_copy, validate_lake
from tests.pipelines.model.text_source import build
from tests.pipelines.training.helpers import SPEC, registered_base_config


@pytest.fixture(scope="module")
def lake(tmp_path_factory) -> str:
    """Four synthetic days (2024-01-02..05, 2,000 rows each) in a local lake, validated (as the DAGs do
    before training: the stages refuse unvalidated days), once per test module."""
    uri = str(tmp_path_factory.mktemp("lake"))
    write_days(Lake(uri), SPEC, "2024-01-02", 4, 2000)
    validate_lake(uri)
    return uri


@pytest.fixture
def serving_store(template_db, tmp_path, monkeypatch):
    """A fresh MLflow store, checkpoints under tmp_path; the tracking URI is reset afterwards."""
    use_store_copy(template_db, tmp_path, monkeypatch)
    monkeypatch.setenv(checkpoint.ROOT_ENV, str(tmp_path / "ckpt"))
    yield
    mlflow.set_tracking_uri(None)


@pytest.fixture
def cfg(serving_store, lake):
    """The small lake's config with its base registered as ctr_base@champion (see registered_base_config)."""
    return registered_base_config(lake)


@pytest.fixture(scope="session")
def text_source(tmp_path_factory) -> str:
    """The directory of a tiny minilm_text source (tests/pipelines/model/text_source.py)."""
    return build(tmp_path_factory.mktemp("text_source"))
