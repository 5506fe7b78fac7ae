"""The registry tests' store: tests/pipelines/conftest.py's fresh SQLite store by default; with the
indirect parameter "http" this process on the session's real `mlflow server` instead (PostgreSQL
backend, artifacts proxied to S3; tests/conftest.py: on_mlflow_server)::

    @pytest.mark.parametrize("serving_store", ["sqlite", pytest.param("http", marks=pytest.mark.slow)],
                             indirect=True)
"""

from __future__ import annotations

import pytest


@pytest.fixture
def serving_store(serving_store, request):
    if getattr(request, "param", "sqlite") == "http":
        # After the parent's set-up (checkpoint root, cwd): the tracking URI and lock URL become the server's.
        request.getfixturevalue("on_mlflow_server")
    yield
