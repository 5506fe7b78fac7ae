"""Trusted loading (issue 13, finding 5): what a load checks is the registry's record, not the artifact store.

Whoever can write the artifact store can change an adapter's files *and* the meta.json next to them.
Such a consistent tamper passes the plain MLflow load (meta.json detects corruption only) but is
refused by `pipelines.registry.pyfunc.load` and by the serving router, which check the version's
tags in the registry database; so is a version whose integrity tag was removed. Both directly on a
SQLite store (files under ./mlruns) and through a real `mlflow server` over HTTP whose artifacts
live on S3 (moto): there the test rewrites the S3 objects behind the server.

The trusted load also never runs code stored with the model: not the stored models-from-code file,
not the pickle and shipped `code/` of a model logged before models-from-code.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import boto3
import mlflow
import numpy as np
import pytest
import torch
from mlflow import MlflowClient

from pipelines.bench import serving_demo as demo
from pipelines.data.schema import FEATURE_FIELDS
from pipelines.errors import RegistryError
from pipelines.model import adapters
from pipelines.model.base import CTRModel
from pipelines.registry import integrity, mlflow_io, pyfunc
from pipelines.serving.router import AdapterServer
from tests.conftest import free_port, stop_mlflow_server
from tests.pipelines.serving import fixtures

REPO = Path(__file__).resolve().parents[3]
WEIGHTS = "artifacts/adapter/adapter_model.safetensors"
BOTH = pytest.mark.parametrize("serving_store", ["sqlite", pytest.param("http", marks=pytest.mark.slow)], indirect=True)


@dataclass(frozen=True)
class StoredModel:
    """A logged model's files where the artifact store keeps them: a local directory, or the S3 objects
    behind the tracking server (`mlflow-artifacts:/…` proxied to `server_artifacts`)."""

    location: str
    server_artifacts: str | None = None

    def _s3(self, rel: str) -> tuple[str, str]:
        assert self.location.startswith("mlflow-artifacts:/"), self.location
        bucket, root = self.server_artifacts.removeprefix("s3://").split("/", 1)
        return bucket, f"{root}/{self.location.removeprefix('mlflow-artifacts:/').strip('/')}/{rel}"

    def read(self, rel: str) -> bytes:
        if self.server_artifacts is None:
            return (Path(self.location.removeprefix("file://")) / rel).read_bytes()

        bucket, key = self._s3(rel)
        return boto3.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read()

    def write(self, rel: str, data: bytes) -> None:
        if self.server_artifacts is None:
            (Path(self.location.removeprefix("file://")) / rel).write_bytes(data)
            return

        bucket, key = self._s3(rel)
        boto3.client("s3").put_object(Bucket=bucket, Key=key, Body=data)


def stored(name: str, version: str, request) -> StoredModel:
    model_id = mlflow_io.get_version(name, version).source.removeprefix("models:/")
    location = MlflowClient().get_logged_model(model_id).artifact_location
    on_server = mlflow.get_tracking_uri().startswith("http")
    return StoredModel(location, request.getfixturevalue("mlflow_server").artifacts if on_server else None)


def tamper_consistently(model: StoredModel) -> None:
    """Change one weight byte and record the new hash in meta.json: what a writer of the store would do."""
    blob = bytearray(model.read(WEIGHTS))
    blob[-5] ^= 0xFF
    model.write(WEIGHTS, bytes(blob))
    meta = json.loads(model.read("artifacts/meta.json"))
    meta["adapter_files"]["adapter_model.safetensors"] = hashlib.sha256(bytes(blob)).hexdigest()
    model.write("artifacts/meta.json", json.dumps(meta, indent=2).encode())


@dataclass
class Small:
    """A base and one adapter slot under names of this test's own (the HTTP server is shared)."""

    base: demo.BaseVersion
    base_model: CTRModel
    example: object
    prefix: str

    @property
    def adapter(self) -> str:
        return f"{self.prefix}feed"

    def add(self, seed: int, alias: str | None = "champion") -> str:
        return demo.add_adapter(self.adapter, "feed", self.base, self.base_model, self.example, seed, alias=alias)

    def server(self) -> AdapterServer:
        return AdapterServer(("feed",), adapter_prefix=self.prefix, cold_start_model=None, base_model=self.base.name)


@pytest.fixture
def small(serving_store, monkeypatch) -> Small:
    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    tag = uuid.uuid4().hex[:8]
    torch.manual_seed(0)
    base_model = CTRModel(fixtures.CFG).eval()
    example = mlflow_io.input_example(fixtures.rows(20))
    base = demo.register_base(base_model, example, name=f"ctr_base_{tag}")
    s = Small(base, base_model, example, f"ctr_lora_{tag}_")
    s.add(seed=1)
    return s


@BOTH
def test_a_consistently_tampered_adapter_is_refused_by_the_pyfunc_and_the_router(small, request):
    server = small.server()
    frame = fixtures.rows(200, "2024-01-11")
    before = server.score(frame)
    v2 = small.add(seed=2, alias=None)
    uri = f"models:/{small.adapter}/{v2}"
    intact = np.asarray(pyfunc.load(uri).predict(frame[list(FEATURE_FIELDS)]))
    tamper_consistently(stored(small.adapter, v2, request))

    # The plain MLflow load checks meta.json only, which the tamper rewrote: it loads, and scores differently.
    plain = np.asarray(mlflow.pyfunc.load_model(uri).predict(frame[list(FEATURE_FIELDS)]))
    assert np.abs(plain - intact).max() > 0
    with pytest.raises(RegistryError, match=rf"v{v2}: adapter files do not match .*adapter_model.safetensors has sha"):
        pyfunc.load(uri)
    # The router: v2 becomes @champion and is refused, v1 keeps serving.
    MlflowClient().set_registered_model_alias(small.adapter, "champion", v2)
    with pytest.raises(RegistryError, match="adapter_model.safetensors has sha256"):
        pyfunc.load(f"models:/{small.adapter}@champion")
    report = server.refresh()
    assert [(r["version"], r["reason"]) for r in report["refused"]] == [(v2, "integrity")]
    assert report["routes"][f"{small.adapter}@champion"] == f"{small.adapter}:1"
    np.testing.assert_array_equal(server.score(frame), before)


@BOTH
def test_a_version_whose_integrity_tags_were_removed_is_refused(small):
    c = MlflowClient()
    v2 = small.add(seed=2, alias=None)
    v3 = small.add(seed=3, alias=None)
    c.delete_model_version_tag(small.adapter, v2, integrity.TAG)
    c.delete_model_version_tag(small.adapter, v3, "base.fingerprint")
    with pytest.raises(RegistryError, match=f"v{v2}: the registry records no 'adapter.sha256'"):
        pyfunc.load(f"models:/{small.adapter}/{v2}")
    with pytest.raises(RegistryError, match=f"v{v3}: the registry records no 'base.fingerprint'"):
        pyfunc.load(f"models:/{small.adapter}/{v3}")
    server = small.server()
    for version, error in ((v2, "no recorded adapter file hashes"), (v3, "no base.fingerprint tag")):
        c.set_registered_model_alias(small.adapter, "champion", version)
        report = server.refresh()
        assert [(r["version"], r["reason"]) for r in report["refused"]] == [(version, "integrity")]
        assert error in report["refused"][0]["error"]
        assert report["routes"][f"{small.adapter}@champion"] == f"{small.adapter}:1"

    # The base: without its fingerprint tag neither it nor an adapter on it loads, and no router starts.
    c.delete_model_version_tag(small.base.name, small.base.version, integrity.FINGERPRINT_TAG)
    with pytest.raises(RegistryError, match="the registry records no 'fingerprint'"):
        pyfunc.load(f"models:/{small.base.name}@champion")
    with pytest.raises(RegistryError, match=f"base {small.base.name} v1: the registry records no 'fingerprint'"):
        pyfunc.load(f"models:/{small.adapter}/1")
    with pytest.raises(RegistryError, match="the registry records no 'fingerprint'"):
        small.server()
    # The session's server is shared: a @champion with no fingerprint reads as an adapter to other tests
    # (status.adapters_on_other_bases), so put the tag back.
    c.set_model_version_tag(small.base.name, small.base.version, integrity.FINGERPRINT_TAG, small.base.fingerprint)


def test_the_trusted_load_runs_no_code_stored_with_the_model(small, tmp_path):
    marker = tmp_path / "stored-code-ran"
    model = stored(small.adapter, "1", None)
    model.write(
        pyfunc.MODEL_FILE.name, f"open({str(marker)!r}, 'w').close()\nraise RuntimeError('stored code ran')\n".encode()
    )
    frame = fixtures.rows(50, "2024-01-11")[list(FEATURE_FIELDS)]
    trusted = pyfunc.load(f"models:/{small.adapter}@champion").predict(frame)
    assert not marker.exists() and np.asarray(trusted).shape == (50,)
    with pytest.raises(mlflow.MlflowException, match="stored code ran"):  # MLflow's own load executes it
        mlflow.pyfunc.load_model(f"models:/{small.adapter}/1")
    assert marker.exists()


def _log_as_before(small: Small, tmp_path: Path) -> str:
    """An adapter logged the way it was before models-from-code: a pickled python_model plus a copy of the
    package (code_paths); registered with the tags registration gave it. Returns its version."""
    adapter_dir = tmp_path / "adapter"
    adapters.save(demo.random_adapter(small.base_model, seed=5), adapter_dir)
    meta = {
        "kind": "adapter",
        "slot": "feed",
        "base": small.base.ref(),
        "adapter_files": integrity.file_hashes(adapter_dir),
    }
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    with mlflow.start_run() as run:
        info = mlflow.pyfunc.log_model(
            name="model",
            python_model=pyfunc.CTRPyfunc(),
            input_example=small.example,
            artifacts={"meta": str(tmp_path / "meta.json"), "adapter": str(adapter_dir)},
            pip_requirements=mlflow_io.pip_requirements(),
            code_paths=[str(REPO / "pipelines")],
        )
    tags = {
        "slot": "feed",
        integrity.TAG: json.dumps(meta["adapter_files"], sort_keys=True),
        **{f"base.{k}": v for k, v in small.base.ref().items()},
    }
    return mlflow_io.register(info.model_uri, small.adapter, tags, run_id=run.info.run_id)


def test_a_model_logged_as_a_pickle_loads_without_its_pickle_or_shipped_code(small, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # MLflow's own load below prepends code/
    version = _log_as_before(small, tmp_path)
    model = stored(small.adapter, version, None)
    assert {"python_model.pkl", "code/pipelines/registry/pyfunc.py"} <= {
        p.relative_to(model.location).as_posix() for p in Path(model.location).rglob("*")
    }
    uri = f"models:/{small.adapter}/{version}"
    frame = fixtures.rows(50, "2024-01-11")[list(FEATURE_FIELDS)]
    before = np.asarray(mlflow.pyfunc.load_model(uri).predict(frame))
    model.write("python_model.pkl", b"not a pickle")  # the trusted load never reads it
    path = list(sys.path)
    np.testing.assert_array_equal(np.asarray(pyfunc.load(uri).predict(frame)), before)
    assert sys.path == path  # the shipped code/ was not put on sys.path
    with pytest.raises(Exception, match="pickle|load"):  # MLflow's own load unpickles it
        mlflow.pyfunc.load_model(uri)


def test_new_models_store_no_pickle_and_no_package_copy(small):
    model = stored(small.adapter, "1", None)
    files = {p.relative_to(model.location).as_posix() for p in Path(model.location).rglob("*") if p.is_file()}
    assert pyfunc.MODEL_FILE.name in files and "artifacts/meta.json" in files and WEIGHTS in files
    assert not any(f.endswith(".pkl") or f.startswith("code/") for f in files), sorted(files)
    assert model.read(pyfunc.MODEL_FILE.name) == pyfunc.MODEL_FILE.read_bytes()
    requirements = model.read("requirements.txt").decode()
    assert f"{mlflow_io.PACKAGE}==" in requirements  # the package is a requirement, not a copy


def test_registration_copies_the_logged_record_and_refuses_a_contradicting_tag(small):
    logged = demo.log_adapter(demo.random_adapter(small.base_model, seed=9), "feed", small.base, small.example)
    version = mlflow_io.register(logged.model_uri, small.adapter, {})  # no tags given
    tags = mlflow_io.get_version(small.adapter, version).tags
    assert tags[integrity.TAG] == logged.hashes
    assert (tags["base.name"], tags["base.version"], tags["base.fingerprint"]) == (
        small.base.name,
        small.base.version,
        small.base.fingerprint,
    )
    assert tags == {
        **tags,
        **integrity.of_tags(MlflowClient().get_logged_model(logged.model_uri.removeprefix("models:/")).tags),
    }
    with pytest.raises(RegistryError, match=r"tags \['adapter.sha256'\] differ from what was recorded"):
        mlflow_io.register(logged.model_uri, small.adapter, {integrity.TAG: "{}"})


def test_only_registry_uris_are_loaded_with_a_record(small, tmp_path):
    run_id = mlflow_io.get_version(small.adapter, "1").run_id
    for uri in (f"runs:/{run_id}/model", str(tmp_path), f"models:/{small.adapter}/latest"):
        with pytest.raises(RegistryError, match="only models:/<name>/<version>"):
            pyfunc.load(uri)
    with pytest.raises(RegistryError, match="does not exist"):
        pyfunc.load(f"models:/{small.adapter}@nobody")
    logged = mlflow_io.get_version(small.adapter, "1").source
    assert np.asarray(pyfunc.load(logged).predict(fixtures.rows(5)[list(FEATURE_FIELDS)])).shape == (5,)


@pytest.mark.slow
def test_mlflow_models_serve_scores_a_registered_adapter_from_the_installed_package(small, tmp_path):
    """`mlflow models serve` (local env manager: the package is installed, no copy of it ships) still works."""
    port, uri = free_port(), f"models:/{small.adapter}@champion"
    bin_dir = Path(sys.executable).parent  # mlflow starts `uvicorn` from PATH
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": mlflow.get_tracking_uri(),
        "CTR_TORCH_THREADS": "1",
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    cmd = [
        str(bin_dir / "mlflow"),
        "models",
        "serve",
        "-m",
        uri,
        "--env-manager",
        "local",
        "-h",
        "127.0.0.1",
        "-p",
        str(port),
        "-w",
        "1",
    ]
    log = tmp_path / "serve.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    frame = fixtures.rows(40, "2024-01-11")[list(FEATURE_FIELDS)]
    body = json.dumps({"dataframe_split": json.loads(frame.to_json(orient="split", index=False))}).encode()
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                request = urllib.request.Request(
                    f"http://127.0.0.1:{port}/invocations", data=body, headers={"Content-Type": "application/json"}
                )
                with urllib.request.urlopen(request, timeout=30) as r:
                    served = np.asarray(json.loads(r.read())["predictions"], dtype=np.float64)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
                time.sleep(1)
    finally:
        stop_mlflow_server(proc)
    np.testing.assert_allclose(served, np.asarray(pyfunc.load(uri).predict(frame), dtype=np.float64), rtol=0, atol=1e-6)
