"""Fixtures of the promotion tests: a fresh SQLite store per test, and the production-like store
(PostgreSQL when reachable, required in CI; else SQLite) for the multi-process tests."""

from __future__ import annotations

import mlflow
import pytest

from tests.conftest import fresh_database, use_store_copy


@pytest.fixture
def tracking(template_db, tmp_path, monkeypatch):
    """A fresh store per test; the tracking URI is reset afterwards."""
    yield use_store_copy(template_db, tmp_path, monkeypatch)
    mlflow.set_tracking_uri(None)


@pytest.fixture
def store_uri(tmp_path):
    """A fresh, empty database: PostgreSQL `ctr_conc_<hex>` when reachable (else SQLite in tmp_path)."""
    with fresh_database("ctr_conc_", tmp_path) as uri:
        try:
            yield uri
        finally:
            mlflow.set_tracking_uri(None)  # before the drop: nothing of this process may hold it open
