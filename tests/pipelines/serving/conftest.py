from __future__ import annotations

import mlflow
import pytest

from tests.conftest import use_store_copy
from tests.pipelines.serving import fixtures


@pytest.fixture
def registry(template_db, tmp_path, monkeypatch) -> fixtures.ServingRegistry:
    """A fresh MLflow store with ctr_base@champion and ctr_lora_<slot>@champion for the 3 synthetic slots."""
    use_store_copy(template_db, tmp_path, monkeypatch)
    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    try:
        yield fixtures.build()
    finally:
        mlflow.set_tracking_uri(None)
