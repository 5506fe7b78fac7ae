"""The MLflow pyfunc that serves pCTR from contract rows (the base model, or base + one LoRA adapter),
and `load`, which loads it only after checking it against the registry.

An adapter version does not copy the base weights: it names the base version it was trained on and
loads it from the registry. What the loaded bytes must match depends on how the model is loaded
(docs/architecture.md, "Registry entries serving can trust"):

* `load(uri)` (evaluation, the monitor, tests): the expected adapter file hashes, base and base
  fingerprint come from the registry database (`registry.integrity.record`, tags of the version or
  logged model `uri` names), never from the artifact store, and no code stored with the model runs.
* `mlflow.pyfunc.load_model(uri)` / `mlflow models serve`: MLflow executes the model file stored
  with the model first; `load_context` then gets no record and checks the adapter files against
  the model's own meta.json. That detects corruption, not tampering. The base is still checked
  against its registered version's fingerprint tag.
Any mismatch refuses to load (RegistryError) rather than serve a wrong model.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

import mlflow.pyfunc
import numpy as np
import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.models import Model

from pipelines.errors import RegistryError
from pipelines.model import adapters, store
from pipelines.model.base import fingerprint
from pipelines.model.family import columns, encode
from pipelines.model.inference import predict
from pipelines.registry import integrity, mlflow_io

# The model_config key through which `load` hands the registry's record to `load_context`. Logged
# with value None so that MLflow accepts it as an override at load time (it ignores unknown keys).
TRUST_KEY = "ctr.registry_record"
# The models-from-code file MLflow logs; `load` runs this installed copy instead of the stored one.
MODEL_FILE = Path(__file__).with_name("pyfunc_model.py")
_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:/(?P<version>\d+)|@(?P<alias>[^/@]+))?$")
# MLflow's loaders of a python model: from code (today), and from a pickle (models logged before).
_LOADER, _PICKLE_LOADER = "mlflow.pyfunc.loaders.code_model", "mlflow.pyfunc.model"
# Where log_ctr_model puts each artifact; `load` reads these paths, not the ones MLmodel lists.
_ARTIFACTS = {"meta": "artifacts/meta.json", "base": "artifacts/base", "adapter": "artifacts/adapter"}


def load_base_from_registry(name: str, version: str, expected_fingerprint: str | None = None):
    """The frozen CTRModel of registered version `name`/`version`. Its weights must hash to the
    fingerprint the registry records on that version, and to `expected_fingerprint` (what an adapter
    was trained on) when given."""
    what = f"base {name} v{version}"
    rec = integrity.of_tags(mlflow_io.get_version(name, version).tags)
    recorded = integrity.required(rec, integrity.FINGERPRINT_TAG, what)
    with tempfile.TemporaryDirectory() as tmp:  # only the weights: never the model's MLmodel or code
        local = mlflow_io.download_artifacts(
            artifact_uri=f"models:/{name}/{version}/{_ARTIFACTS['base']}", dst_path=tmp
        )
        model = store.load_base(local, family=integrity.family_of(rec))
    actual = fingerprint(model)
    integrity.check_fingerprint(actual, recorded, what)
    if expected_fingerprint is not None and actual != expected_fingerprint:
        raise RegistryError(
            f"{what} has fingerprint {actual[:12]}..., but this adapter was trained on "
            f"{expected_fingerprint[:12]}...; refusing to load"
        )
    return model


class CTRPyfunc(mlflow.pyfunc.PythonModel):
    def load_context(self, context):
        path = context.artifacts.get("meta")
        try:
            self.meta = json.loads(Path(path).read_text())
        except (TypeError, OSError, json.JSONDecodeError) as exc:
            raise RegistryError(f"the model's meta.json is missing or unreadable ({exc})") from exc
        rec = (context.model_config or {}).get(TRUST_KEY)
        expected = _from_registry(self.meta, rec) if rec else _from_meta(self.meta)
        self.model = _load_checked(self.meta, context.artifacts, expected)
        self._cfg = self.model.cfg if hasattr(self.model, "cfg") else self.model.get_base_model().cfg

    def predict(self, context, model_input: pd.DataFrame, params=None) -> np.ndarray:
        missing = [c for c in columns(self._cfg)[0] if c not in model_input.columns]
        if missing:
            raise RegistryError(f"input is missing feature columns {missing}")
        return predict(self.model, encode(model_input, self._cfg))


def _from_registry(meta: dict, rec: dict) -> dict:
    """What the files must match, from the registry's record `load` passed (missing entries refuse)."""
    what = rec.get("what", "model")
    if meta.get("kind") == "base":
        return {
            "what": what,
            "fingerprint": integrity.required(rec, integrity.FINGERPRINT_TAG, what),
            "family": integrity.family_of(rec),
        }
    if meta.get("kind") != "adapter" or not isinstance(meta.get("base"), dict):
        raise RegistryError(f"{what}: meta.json is neither a base's nor an adapter's (kind={meta.get('kind')!r})")
    b = meta["base"]
    name, version = rec.get("base.name") or b.get("name"), rec.get("base.version") or b.get("version")
    if (str(b.get("name")), str(b.get("version"))) != (str(name), str(version)):
        raise RegistryError(
            f"{what}: meta.json names base {b.get('name')} v{b.get('version')}, the registry "
            f"records {name} v{version}; refusing to load"
        )
    return {
        "what": what,
        "adapter_files": integrity.required(rec, integrity.TAG, what),
        "base": (str(name), str(version), integrity.required(rec, "base.fingerprint", what)),
    }


def _from_meta(meta: dict) -> dict:
    """What the files must match when nothing from the registry was passed: the model's own meta.json."""
    if meta.get("kind") == "base":  # models logged before the fingerprint went into meta.json: unchecked
        return {"what": "base model", "fingerprint": meta.get("fingerprint")}
    b = meta.get("base")
    if meta.get("kind") != "adapter" or not isinstance(b, dict):
        raise RegistryError(f"meta.json is neither a base's nor an adapter's (kind={meta.get('kind')!r})")
    return {
        "what": f"adapter of slot {meta.get('slot')!r} (base {b['name']} v{b['version']})",
        "adapter_files": meta.get("adapter_files"),
        "base": (b["name"], str(b["version"]), b["fingerprint"]),
    }


def _load_checked(meta: dict, artifacts: dict, expected: dict):
    what = expected["what"]
    key = "base" if meta.get("kind") == "base" else "adapter"
    if not artifacts.get(key):
        raise RegistryError(f"{what}: the model has no {key} artifact")
    if key == "base":
        # no registry record (`_from_meta`): only a built-in family loads, never one meta.json names
        model = store.load_base(artifacts["base"], family=expected.get("family"))
        if expected["fingerprint"]:
            integrity.check_fingerprint(fingerprint(model), expected["fingerprint"], what)
        return model
    integrity.verify_files(artifacts["adapter"], expected["adapter_files"], what)
    return adapters.load(load_base_from_registry(*expected["base"]), artifacts["adapter"])


def load(model_uri: str) -> mlflow.pyfunc.PyFuncModel:
    """`model_uri` as a pyfunc, checked against the registry database before anything it stores runs.

    `model_uri` is `models:/<name>/<version>`, `models:/<name>@<alias>` (resolved once, then that
    version is loaded) or a logged model's `models:/m-<id>` (the model a training run logged, before
    it is registered). The downloaded copy is rewritten to run the installed `pyfunc_model.py`: a
    stored model file, a pickled `python_model` and a `code/` directory (models logged before
    models-from-code) are never executed. RegistryError when the registry holds no complete record
    or the files differ from it.
    """
    pinned, rec = registry_record(model_uri)
    with tempfile.TemporaryDirectory() as tmp:  # everything is in memory once loaded
        try:
            local = Path(mlflow_io.download_artifacts(artifact_uri=pinned, dst_path=tmp))
        except Exception as exc:
            raise RegistryError(f"{rec['what']}: cannot download {pinned}: {type(exc).__name__}: {exc}") from exc
        _use_installed_code(local, rec["what"])
        return mlflow.pyfunc.load_model(str(local), model_config={TRUST_KEY: rec})


def registry_record(model_uri: str) -> tuple[str, dict]:
    """(the URI to download, the integrity record the registry holds for it, plus "what": its name)."""
    m = _URI.match(model_uri)
    if m is None:
        raise RegistryError(
            f"{model_uri}: only models:/<name>/<version>, models:/<name>@<alias> and "
            "models:/m-<logged model id> are loaded with a registry record to check against"
        )
    name, version, alias = m["name"], m["version"], m["alias"]
    if version is None and alias is None:
        try:
            tags = mlflow_io.client().get_logged_model(name).tags
        except MlflowException as exc:
            raise RegistryError(f"{model_uri}: no such logged model ({exc.message})") from exc
        except Exception as exc:  # transport errors of a remote tracking server are not MlflowExceptions
            raise RegistryError(f"{model_uri}: cannot read the logged model: {type(exc).__name__}: {exc}") from exc
        return f"models:/{name}", {**integrity.of_tags(tags), "what": f"logged model {name}"}
    if alias is not None:
        mv = mlflow_io.version_by_alias(name, alias)
        if mv is None:
            raise RegistryError(f"{model_uri}: {name}@{alias} does not exist")
        version = str(mv.version)
    else:
        mv = mlflow_io.get_version(name, version)
    return f"models:/{name}/{version}", {**integrity.of_tags(mv.tags), "what": f"{name} v{version}"}


def _use_installed_code(local: Path, what: str) -> None:
    """Rewrite the downloaded model's pyfunc flavor so that loading it runs installed code only.

    Whoever can write the artifact store can change MLmodel, the stored model file, a pickle or a
    shipped `code/` directory; MLflow would run each of them before `load_context` checks anything.
    Kept from the stored flavor: only the environment entries, which no local load executes.
    """
    try:
        model = Model.load(str(local / "MLmodel"))
    except Exception as exc:
        raise RegistryError(f"{what}: unreadable MLmodel ({type(exc).__name__}: {exc})") from exc
    conf = model.flavors.get("python_function") or {}
    if conf.get("loader_module") not in (_LOADER, _PICKLE_LOADER):
        raise RegistryError(
            f"{what}: MLmodel names loader {conf.get('loader_module')!r}, not a python model's "
            f"({_LOADER}); it is not a CTR pyfunc"
        )
    if not (local / _ARTIFACTS["meta"]).is_file():
        raise RegistryError(f"{what}: the model has no {_ARTIFACTS['meta']}")
    shutil.copyfile(MODEL_FILE, local / MODEL_FILE.name)
    model.flavors["python_function"] = {
        **{k: conf[k] for k in ("env", "python_version") if k in conf},
        "loader_module": _LOADER,
        "model_code_path": MODEL_FILE.name,
        "config": {TRUST_KEY: None},
        "artifacts": {k: {"path": p} for k, p in _ARTIFACTS.items() if (local / p).exists()},
    }
    model.save(str(local / "MLmodel"))
