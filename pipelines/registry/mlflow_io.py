"""MLflow plumbing shared by the stages: experiments, logging the pyfunc, registration, lineage.

Tracking and artifact settings come from the standard environment (`MLFLOW_TRACKING_URI`,
`AWS_ENDPOINT_URL` / `MLFLOW_S3_ENDPOINT_URL`); `CTR_MLFLOW_ARTIFACT_ROOT` (e.g. s3://bucket/mlflow)
places new experiments' artifacts there. Against a tracking server that proxies artifacts
(`mlflow server --artifacts-destination s3://… --serve-artifacts`) leave it unset: new experiments
then get the server's `mlflow-artifacts:/` root, every upload and download (logged models, the pyfunc's
base, model cards) goes through the server, and clients need no S3 endpoint or credentials. Everything
here works the same on a directly opened SQLite / PostgreSQL store and over HTTP
(tests/pipelines/registry/test_http_registry.py).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import warnings
from importlib import metadata
from pathlib import Path

import pandas as pd

from pipelines.config import REPO_ROOT
from pipelines.data.schema import FEATURE_FIELDS
from pipelines.errors import RegistryError

PIP_PACKAGES = ("torch", "peft", "mlflow", "pandas", "numpy", "pyarrow", "safetensors", "scikit-learn", "PyYAML")


def client():
    from mlflow import MlflowClient

    return MlflowClient()


def ensure_experiment(name: str) -> str:
    import mlflow

    exp = mlflow.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    root = os.environ.get("CTR_MLFLOW_ARTIFACT_ROOT")
    try:
        return mlflow.create_experiment(name, artifact_location=f"{root.rstrip('/')}/{name}" if root else None)
    except Exception:  # created concurrently by another task: use theirs
        exp = mlflow.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def code_version() -> str:
    """Git commit of the code that ran (with -dirty for uncommitted changes), else the package version."""
    if os.environ.get("CTR_CODE_VERSION"):
        return os.environ["CTR_CODE_VERSION"]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "pkg-" + metadata.version("ctr-lora-ops")


def pip_requirements() -> list[str]:
    out = []
    for pkg in PIP_PACKAGES:
        v = metadata.version(pkg).split("+")[0]
        out.append(f"{pkg}=={v}")
    return out


def input_example(frame: pd.DataFrame, rows: int = 5) -> pd.DataFrame:
    ex = frame.loc[:, list(FEATURE_FIELDS)].head(rows).copy()
    for c in ex.columns:
        ex[c] = ex[c].astype("int64") if c in ("hour", "weekday") else ex[c].astype(object)
    return ex.reset_index(drop=True)


def log_ctr_model(meta: dict, example: pd.DataFrame, base_dir: str | None = None,
                  adapter_dir: str | None = None, name: str = "model"):
    """Log the CTR pyfunc in the active run; returns mlflow's ModelInfo (model_uri = models:/m-...).

    With `adapter_dir`, the sha256 of each adapter file goes into the model's meta.json (checked by
    the pyfunc at load) and onto the run as tag `adapter.sha256` (copied to the version at
    registration, checked by the serving router against the registry's own copy).
    """
    import mlflow

    from pipelines.registry import integrity
    from pipelines.registry.pyfunc import CTRPyfunc

    if adapter_dir:
        meta = {**meta, "adapter_files": integrity.file_hashes(adapter_dir)}
        mlflow.set_tag(integrity.TAG, json.dumps(meta["adapter_files"], sort_keys=True))
    with tempfile.TemporaryDirectory() as tmp:
        meta_path = Path(tmp) / "meta.json"
        meta_path.write_text(json.dumps(meta, indent=2))
        artifacts = {"meta": str(meta_path)}
        # MLflow stores each artifact under its own basename: stage them as base/ and adapter/ so
        # the loaded layout is fixed (artifacts/base, artifacts/adapter).
        for key, src in (("base", base_dir), ("adapter", adapter_dir)):
            if src:
                artifacts[key] = str(shutil.copytree(src, Path(tmp) / key))
        with warnings.catch_warnings():
            # hour/weekday are never missing (the contract forbids nulls), so MLflow's hint about
            # integer columns and missing values does not apply.
            warnings.filterwarnings("ignore", message=".*integer column", category=UserWarning)
            return mlflow.pyfunc.log_model(
                name=name, python_model=CTRPyfunc(), artifacts=artifacts, input_example=example,
                pip_requirements=pip_requirements(), code_paths=[str(REPO_ROOT / "pipelines")])


def register(model_uri: str, name: str, tags: dict, alias: str | None = None, run_id: str | None = None) -> str:
    """Register model_uri as a new version of `name` with tags (and an alias); returns the version."""
    c = client()
    try:
        c.get_registered_model(name)
    except Exception:
        try:
            c.create_registered_model(name)
        except Exception:  # created concurrently
            c.get_registered_model(name)
    # A tracking server (HTTP) accepts a `models:/m-...` source only together with the logged model's
    # id; a directly opened store accepts either. Passing the id always keeps the lineage link too.
    from mlflow.store.artifact.utils.models import _parse_model_id_if_present

    mv = c.create_model_version(name=name, source=model_uri, run_id=run_id,
                                tags={k: str(v) for k, v in tags.items()},
                                model_id=_parse_model_id_if_present(model_uri))
    if alias:
        c.set_registered_model_alias(name, alias, mv.version)
    return str(mv.version)


def version_by_alias(name: str, alias: str):
    """The ModelVersion behind name@alias, or None when the model or alias does not exist."""
    from mlflow.exceptions import MlflowException

    try:
        return client().get_model_version_by_alias(name, alias)
    except MlflowException:
        return None


def get_version(name: str, version: str):
    from mlflow.exceptions import MlflowException

    try:
        return client().get_model_version(name, str(version))
    except MlflowException as exc:
        raise RegistryError(f"{name} version {version} does not exist") from exc
