"""Fixtures of the promotion tests: a fresh SQLite store per test, and the production-like store
(PostgreSQL when reachable, required in CI; else SQLite) for the multi-process tests."""
from __future__ import annotations

import os
import uuid

import mlflow
import pytest

from tests.conftest import use_store_copy
from tests.e2e.stack import PG, postgres_available


@pytest.fixture
def tracking(template_db, tmp_path, monkeypatch):
    """A fresh store per test; the tracking URI is reset afterwards."""
    yield use_store_copy(template_db, tmp_path, monkeypatch)
    mlflow.set_tracking_uri(None)


@pytest.fixture
def store_uri(tmp_path):
    if postgres_available():
        import psycopg2

        name = f"ctr_conc_{uuid.uuid4().hex[:10]}"
        conn = psycopg2.connect(**PG)
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(f'CREATE DATABASE "{name}"')
        try:
            yield f"postgresql://postgres@127.0.0.1:5432/{name}"
        finally:
            mlflow.set_tracking_uri(None)
            with conn.cursor() as cur:
                cur.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            conn.close()
    elif os.environ.get("CTR_REQUIRE_POSTGRES") == "1":
        pytest.fail("CTR_REQUIRE_POSTGRES=1 but PostgreSQL at 127.0.0.1:5432 is not reachable")
    else:
        yield f"sqlite:///{tmp_path / 'mlflow.db'}"
        mlflow.set_tracking_uri(None)
