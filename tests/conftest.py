"""Shared fixtures: a real S3-compatible server (moto's server mode) on 127.0.0.1, over HTTP."""
from __future__ import annotations

import os
import socket
import uuid

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_endpoint():
    """Start moto's threaded HTTP server once per session and point boto3 at it via AWS_ENDPOINT_URL."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    old = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                          "AWS_DEFAULT_REGION", "MLFLOW_S3_ENDPOINT_URL")}
    os.environ.update({"AWS_ENDPOINT_URL": endpoint, "MLFLOW_S3_ENDPOINT_URL": endpoint,
                       "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"})
    yield endpoint
    server.stop()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def s3_bucket(s3_endpoint):
    """A fresh, empty bucket on the moto server."""
    import boto3

    name = f"test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=name)
    return name


def use_store_copy(template_db, tmp_path, monkeypatch) -> str:
    """Point MLflow (tracking + registry) at a fresh copy of an initialised SQLite store.

    Creating the schema takes seconds, copying the file does not. Any default ./mlruns artifact root
    lands in tmp_path. The caller resets the tracking URI afterwards.
    """
    import shutil

    import mlflow

    db = tmp_path / "mlflow.db"
    shutil.copy(template_db, db)
    uri = f"sqlite:///{db}"
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CTR_MLFLOW_ARTIFACT_ROOT", raising=False)
    monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
    # An experiment made active in an earlier test's store (mlflow.set_experiment exports it) does not
    # exist in this one.
    monkeypatch.delenv("MLFLOW_EXPERIMENT_ID", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    import mlflow.tracking.fluent as fluent

    monkeypatch.setattr(fluent, "_active_experiment_id", None)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    return uri


@pytest.fixture(scope="session")
def template_db(tmp_path_factory):
    """An initialised, empty MLflow SQLite store to copy with `use_store_copy`."""
    from mlflow import MlflowClient

    d = tmp_path_factory.mktemp("mlflow-template")
    uri = f"sqlite:///{d / 'mlflow.db'}"
    MlflowClient(tracking_uri=uri, registry_uri=uri).search_experiments()
    return d / "mlflow.db"
