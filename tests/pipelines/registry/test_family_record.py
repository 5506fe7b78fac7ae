"""The registry records a base's model family (`model.family`, issue 15), and every load builds the family the
registry names: a user's family loads because the record vouches for it, a base whose stored config names
another family is refused, and a base registered before families existed loads as the default. On a SQLite
store and through a real `mlflow server` over HTTP with S3 artifacts."""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest
import torch
from mlflow import MlflowClient

from pipelines.config import ModelConfig
from pipelines.errors import RegistryError
from pipelines.model import family
from pipelines.registry import integrity, mlflow_io, pyfunc
from pipelines.bench import serving_demo as demo
from pipelines.serving.router import AdapterServer
from tests.pipelines.model.test_family import TinyFamily
from tests.pipelines.registry.test_trusted_load import BOTH, stored
from tests.pipelines.serving import fixtures

TINY = TinyFamily.name


def register(family_name: str, prefix: str):
    torch.manual_seed(0)
    cfg = ModelConfig(**{**fixtures.CFG.__dict__, "family": family_name})
    model = family.build(cfg).eval()
    example = mlflow_io.input_example(fixtures.rows(20))
    base = demo.register_base(model, example, name=f"{prefix}base")
    return base, model, example


def test_the_record_default_is_the_model_default():
    assert integrity.DEFAULT_FAMILY == family.DEFAULT
    assert integrity.family_of({}) == family.DEFAULT and integrity.family_of({integrity.FAMILY_TAG: TINY}) == TINY


@BOTH
def test_a_users_family_is_recorded_and_loads_everywhere_the_registry_vouches_for_it(serving_store, monkeypatch):
    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    prefix = f"fam_{uuid.uuid4().hex[:8]}_"
    base, model, example = register(TINY, prefix)
    assert mlflow_io.get_version(base.name, base.version).tags[integrity.FAMILY_TAG] == TINY
    loaded = pyfunc.load_base_from_registry(base.name, base.version, base.fingerprint)
    assert loaded.built_by == "tiny"
    demo.add_adapter(f"{prefix}feed", "feed", base, model, example, seed=1, alias="champion")
    served = pyfunc.load(f"models:/{prefix}feed@champion")  # the trusted pyfunc: base of that family
    rows = fixtures.rows(64)
    server = AdapterServer(("feed",), adapter_prefix=prefix, cold_start_model=None, base_model=base.name)
    probs, versions = server.score(rows, return_versions=True)
    on_adapter = versions == f"{prefix}feed:1"
    assert on_adapter.sum() > 10  # the feed slot's rows
    np.testing.assert_allclose(
        probs[on_adapter], np.asarray(served.predict(rows[on_adapter])).reshape(-1), atol=1e-6, rtol=0
    )


@BOTH
def test_a_base_whose_files_name_another_family_than_its_record_is_refused(serving_store, monkeypatch, request):
    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    prefix = f"fam_{uuid.uuid4().hex[:8]}_"
    base, _, _ = register(TINY, prefix)
    files = stored(base.name, base.version, request)
    config = json.loads(files.read("artifacts/base/model_config.json"))
    config["model"]["family"] = "feature_transformer"  # the artifact store says otherwise
    files.write("artifacts/base/model_config.json", json.dumps(config).encode())
    with pytest.raises(RegistryError, match="names model family 'feature_transformer'"):
        pyfunc.load_base_from_registry(base.name, base.version)

    other, _, _ = register("feature_transformer", f"{prefix}x_")
    MlflowClient().set_model_version_tag(other.name, other.version, integrity.FAMILY_TAG, TINY)  # the record lies
    with pytest.raises(RegistryError, match=f"but {TINY} was expected"):
        pyfunc.load_base_from_registry(other.name, other.version)


def test_a_base_registered_before_families_loads_as_the_default(serving_store):
    base, model, _ = register("feature_transformer", f"fam_{uuid.uuid4().hex[:8]}_")
    MlflowClient().delete_model_version_tag(base.name, base.version, integrity.FAMILY_TAG)
    loaded = pyfunc.load_base_from_registry(base.name, base.version, base.fingerprint)
    assert type(loaded) is type(model) and not hasattr(loaded, "built_by")
