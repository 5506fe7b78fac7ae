"""Registry calls ride out a tracking server that answers 503 or drops connections, and fail (never
read as "absent") beyond the retry budget. A real `mlflow server` (tests/conftest.py: mlflow_server)
behind tests/pipelines/data/test_s3_retries.py's FaultProxy; MLflow's own client does the retrying,
configured in one place (pipelines/registry/mlflow_io.py: HTTP_RETRY_SETTINGS)."""

from __future__ import annotations

import uuid

import mlflow
import mlflow.artifacts
import pytest
from mlflow import MlflowClient
from mlflow.environment_variables import MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR, MLFLOW_HTTP_REQUEST_MAX_RETRIES
from mlflow.exceptions import MlflowException

from pipelines.registry import mlflow_io
from tests.pipelines.data.s3_faults import FaultProxy


@pytest.fixture
def via(mlflow_server, tmp_path, monkeypatch):
    """`via(proxy)`: point this process's MLflow client at `proxy` (in front of the session's server),
    with the library's retry settings but short waits (backoff factor 1, no jitter: 0, 2, 4 s)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_JITTER", "0")

    def point(proxy: FaultProxy) -> None:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", proxy.url)
        mlflow.set_tracking_uri(proxy.url)

    yield point
    mlflow.set_tracking_uri(None)


def test_the_library_configures_mlflow_retries(monkeypatch):
    for key in (*mlflow_io.HTTP_RETRY_SETTINGS, *mlflow_io.S3_RETRY_SETTINGS):
        monkeypatch.delenv(key, raising=False)
    mlflow_io.configure_http_retries()
    assert MLFLOW_HTTP_REQUEST_MAX_RETRIES.get() == 7 and MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR.get() == 2
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "3")  # an operator's own setting wins
    mlflow_io.configure_http_retries()
    assert MLFLOW_HTTP_REQUEST_MAX_RETRIES.get() == 3


def test_registry_calls_survive_503s_and_dropped_connections(mlflow_server, via):
    name = f"retry_{uuid.uuid4().hex[:8]}"
    with FaultProxy(
        mlflow_server.uri, "503", failures=2, match=lambda m, p: m == "POST" and "registered-models/create" in p
    ) as proxy:
        via(proxy)
        mlflow_io.client().create_registered_model(name)
    assert len(proxy.faulted) == 2
    with FaultProxy(mlflow_server.uri, "reset", failures=2, match=lambda m, p: "alias" in p) as proxy:
        via(proxy)
        # absent alias, asked through two dropped connections: None (absent), not an error
        assert mlflow_io.version_by_alias(name, "champion") is None
    assert len(proxy.faulted) == 2
    assert MlflowClient(tracking_uri=mlflow_server.uri).get_registered_model(name).name == name


def test_beyond_the_retry_budget_an_outage_is_an_error_not_absence(mlflow_server, via, monkeypatch):
    name = f"retry_{uuid.uuid4().hex[:8]}"
    MlflowClient(tracking_uri=mlflow_server.uri).create_registered_model(name)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    with FaultProxy(mlflow_server.uri, "503", failures=1000, match=lambda m, p: "alias" in p) as proxy:
        via(proxy)
        with pytest.raises(MlflowException, match="503"):
            mlflow_io.version_by_alias(name, "champion")
    assert len(proxy.faulted) == 3  # the first try and two retries


def test_an_artifact_download_cut_off_midway_is_run_again(mlflow_server, via, tmp_path):
    """MLflow retries until a response starts, not a body that breaks off: mlflow_io.download_artifacts
    runs the download again."""
    direct = MlflowClient(tracking_uri=mlflow_server.uri)
    exp = direct.create_experiment(f"retry-{uuid.uuid4().hex[:8]}")
    run = direct.create_run(exp).info.run_id
    text = "".join(f"line {i}\n" for i in range(5000))
    direct.log_text(run, text, "notes/a.txt")

    def file_get(method: str, path: str) -> bool:
        return method == "GET" and "?" not in path and path.endswith("notes/a.txt")

    uri = f"runs:/{run}/notes/a.txt"
    with FaultProxy(mlflow_server.uri, "truncate", failures=1, match=file_get) as proxy:
        via(proxy)
        with pytest.raises(MlflowException):  # the gap the wrapper closes
            mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(tmp_path / "plain"))
    with FaultProxy(mlflow_server.uri, "truncate", failures=1, match=file_get) as proxy:
        via(proxy)
        local = mlflow_io.download_artifacts(artifact_uri=uri, dst_path=str(tmp_path / "wrapped"))
    assert len(proxy.faulted) == 1
    assert open(local).read() == text


def test_a_missing_artifact_fails_and_a_refusal_is_final(mlflow_server, via, tmp_path):
    name = f"retry_{uuid.uuid4().hex[:8]}"
    direct = MlflowClient(tracking_uri=mlflow_server.uri)
    direct.create_registered_model(name)
    run = direct.create_run(direct.create_experiment(f"retry-{uuid.uuid4().hex[:8]}")).info.run_id
    with FaultProxy(mlflow_server.uri, "503", failures=0) as proxy:
        via(proxy)
        with pytest.raises(MlflowException, match="missing.txt"):  # tried DOWNLOAD_ATTEMPTS times, then raised
            mlflow_io.download_artifacts(artifact_uri=f"runs:/{run}/missing.txt", dst_path=str(tmp_path))
        before = len(proxy.forwarded)
        with pytest.raises(MlflowException) as err:  # no such alias: asked once
            mlflow_io.download_artifacts(artifact_uri=f"models:/{name}@champion", dst_path=str(tmp_path))
    assert err.value.error_code == "INVALID_PARAMETER_VALUE"
    assert len(proxy.forwarded) - before == 1
