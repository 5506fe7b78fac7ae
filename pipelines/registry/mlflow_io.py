"""MLflow plumbing shared by the stages: experiments, logging the pyfunc, registration, lineage.

Tracking and artifact settings come from the standard environment (`MLFLOW_TRACKING_URI`,
`AWS_ENDPOINT_URL` / `MLFLOW_S3_ENDPOINT_URL`); `CTR_MLFLOW_ARTIFACT_ROOT` (e.g. s3://bucket/mlflow)
places new experiments' artifacts there. Against a tracking server that proxies artifacts
(`mlflow server --artifacts-destination s3://… --serve-artifacts`) leave it unset: new experiments
then get the server's `mlflow-artifacts:/` root, every upload and download (logged models, the pyfunc's
base, model cards) goes through the server, and clients need no S3 endpoint or credentials. Everything
here works the same on a directly opened SQLite / PostgreSQL store and over HTTP
(tests/pipelines/registry/test_http_registry.py). Requests to a tracking server retry transient
failures with backoff (HTTP_RETRY_SETTINGS); artifact downloads should go through `download_artifacts`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import subprocess
import tempfile
import time
import warnings
from importlib import metadata
from pathlib import Path

import mlflow
import mlflow.artifacts
import numpy as np
import pandas as pd
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from mlflow.models import ModelSignature, infer_signature
from mlflow.store.artifact.utils.models import _parse_model_id_if_present
from mlflow.types.schema import ColSpec, Schema

from pipelines.config import REPO_ROOT, ModelConfig
from pipelines.data.lake import S3_MAX_ATTEMPTS
from pipelines.data.schema import FEATURE_FIELDS, OPTIONAL
from pipelines.errors import RegistryError
from pipelines.registry import integrity, runs

log = logging.getLogger(__name__)

PACKAGE = "ctr-lora-ops"
PIP_PACKAGES = ("torch", "peft", "mlflow", "pandas", "numpy", "pyarrow", "safetensors", "scikit-learn", "PyYAML")
PACKAGE_DIR = REPO_ROOT / "pipelines"  # the shipped package (docker/Dockerfile: COPY pipelines/)

# MLflow's REST client (mlflow/utils/rest_utils.py: http_request) retries every tracking, registry and
# artifact-proxy request, whatever its method, on 408/429/500/502/503/504 and on refused, reset or
# timed-out connections: urllib3's Retry, waiting backoff_factor * 2**(n-1) s before retry n (the first
# at once, each capped at 120 s) plus up to `jitter` s. It reads these variables at every request, so
# they are pinned here, in one place, against a change of MLflow's defaults; an operator's own
# setting wins. 7 retries at factor 2 wait 0, 4, 8, ... 120 s: ~4 min, a tracking-server restart.
HTTP_RETRY_SETTINGS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "7",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "1.0",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "120",  # per request, then retried like a dropped connection
}
# MLflow's own S3 client (an s3:// artifact root written without a proxying server) gets no retry
# config from MLflow: botocore then reads these, so it retries like the lake's clients (lake.s3_config).
S3_RETRY_SETTINGS = {"AWS_RETRY_MODE": "standard", "AWS_MAX_ATTEMPTS": str(S3_MAX_ATTEMPTS)}
# What MLflow does not retry: a streamed artifact download whose body breaks off after the response
# started (`HttpArtifactRepository._download_file` reads it outside the retry). `download_artifacts`
# runs the whole download again, up to this many times. MLflow reports such a cut under more than one
# error code (INTERNAL_ERROR; RESOURCE_DOES_NOT_EXIST from a runs:/ URI, which swallows the cause), so
# only the codes that can never come from a transfer are final at once.
DOWNLOAD_ATTEMPTS = 3
_FINAL = ("INVALID_PARAMETER_VALUE", "PERMISSION_DENIED", "UNAUTHENTICATED")
# Error codes that say the model, version or alias is not there; any other MlflowException (the
# server unreachable after the retries above, a 5xx) is re-raised as is, never read as "absent".
_ABSENT = ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE")


def configure_http_retries() -> None:
    """Apply HTTP_RETRY_SETTINGS and S3_RETRY_SETTINGS where the environment does not set them (done
    on import)."""
    for key, value in {**HTTP_RETRY_SETTINGS, **S3_RETRY_SETTINGS}.items():
        os.environ.setdefault(key, value)


# On import: every MLflow call of the library is made by a module that imports this one.
configure_http_retries()


def client():
    return MlflowClient()


def ensure_experiment(name: str) -> str:
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
    """What identifies the code that ran (lineage tags, the registration idempotency key); never empty.

    `CTR_CODE_VERSION` when set (images: the build arg), else the git commit of the checkout this
    package lives in (`<sha>-dirty-<source hash>` with uncommitted changes, so two different edits
    never share a key), else `src-<source hash>`: an image or a copy without .git or without git.
    """
    explicit = os.environ.get("CTR_CODE_VERSION", "").strip()
    if explicit:
        return explicit
    git = _git_state()
    if git is None:
        return "src-" + source_hash()[:16]
    sha, dirty = git
    return f"{sha}-dirty-{source_hash()[:12]}" if dirty else sha


def _git_state() -> tuple[str, bool] | None:
    """(HEAD, uncommitted changes) of the git checkout whose root holds this package; None when there is
    none (git missing, no .git, or REPO_ROOT only nested inside some other repository)."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=5, check=True
        ).stdout

    try:
        if Path(git("rev-parse", "--show-toplevel").strip()).resolve() != REPO_ROOT.resolve():
            return None
        sha = git("rev-parse", "HEAD").strip()
        status = git("status", "--porcelain", "--untracked-files=normal").splitlines()
    except (OSError, subprocess.SubprocessError):
        return None
    # Tracked changes anywhere, or a file of the package not yet added (an import of it changes what
    # runs); other untracked files (scratch, outputs) do not change the code.
    dirty = any(not line.startswith("??") or line[3:].startswith("pipelines/") for line in status)
    return sha, dirty


def source_hash(root: Path = PACKAGE_DIR) -> str:
    """sha256 over every file under `root` (the `pipelines` package as shipped), each by its relative
    path and its bytes, in path order. `__pycache__` and .pyc/.pyo files are left out: they depend on
    the interpreter that ran, not on the code."""
    files = sorted(
        (p.relative_to(root).as_posix(), p)
        for p in root.rglob("*")
        if p.is_file() and "__pycache__" not in p.relative_to(root).parts and p.suffix not in (".pyc", ".pyo")
    )
    digest = hashlib.sha256()
    for rel, path in files:
        digest.update(rel.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def pip_requirements() -> list[str]:
    """The pinned requirements of a logged model, this package included: the model stores no copy of
    its code (models-from-code imports `pipelines` from the environment that loads it)."""
    out = []
    for pkg in (*PIP_PACKAGES, PACKAGE):
        try:
            v = metadata.version(pkg).split("+")[0]
        except metadata.PackageNotFoundError as exc:
            raise RegistryError(
                f"{pkg} is not installed (pip install -e . for {PACKAGE}): a logged model "
                "names the exact versions it needs"
            ) from exc
        out.append(f"{pkg}=={v}")
    return out


def input_example(frame: pd.DataFrame, model_cfg=None, rows: int = 5) -> pd.DataFrame:
    """The first rows of `frame`, cut to what a model of `model_cfg`'s family reads (the default family's
    FEATURE_FIELDS without one): the logged signature, which evaluation cuts its frames to
    (registry.model_input), so a text family's columns must be in it."""
    cols = list(FEATURE_FIELDS)
    if model_cfg is not None:
        from pipelines.model import family  # noqa: PLC0415  torch: status, history read the registry here

        required, optional = family.columns(model_cfg)
        # every optional column the family reads, present or not: one left out of the signature would be
        # cut from every evaluation frame (registry.model_input), and the model judged without it
        frame = frame.assign(
            **{c: pd.Series("", index=frame.index, dtype="string") for c in optional if c not in frame.columns}
        )
        cols = list(required) + list(optional)
    ex = frame.loc[:, cols].head(rows).copy()
    for c in ex.columns:
        ex[c] = ex[c].astype("int64") if c in ("hour", "weekday") else ex[c].astype(object)
        if ex[c].dtype == object:  # a null text becomes "" (MLflow infers no type from None)
            ex[c] = ex[c].where(ex[c].notna(), "")
    return ex.reset_index(drop=True)


def log_ctr_model(
    meta: dict, example: pd.DataFrame, base_dir: str | None = None, adapter_dir: str | None = None, name: str = "model"
):
    """Log the CTR pyfunc in the active run; returns mlflow's ModelInfo (model_uri = models:/m-...).

    Logged as models-from-code (`registry/pyfunc_model.py`): no pickled object and no copy of the
    package is stored, so loading needs the package installed (it is in pip_requirements). The
    model's integrity record (`integrity.record`: an adapter's file hashes and its base, a base's
    weight fingerprint) goes into meta.json and onto the logged model as tags, which `register`
    copies onto the version; an adapter's hashes also onto the run (tag `adapter.sha256`).
    """
    from pipelines.registry.pyfunc import MODEL_FILE, TRUST_KEY  # noqa: PLC0415  torch: status, history read the registry here

    meta = _with_hashes(meta, base_dir, adapter_dir)
    record = integrity.record(meta)
    if meta["kind"] == "adapter":
        mlflow.set_tag(integrity.TAG, record[integrity.TAG])
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
                name=name,
                python_model=str(MODEL_FILE),
                model_config={TRUST_KEY: None},
                artifacts=artifacts,
                pip_requirements=pip_requirements(),
                tags=record,
                **_example_or_signature(meta, example),
            )


def _example_or_signature(meta: dict, example: pd.DataFrame) -> dict:
    """How MLflow learns the model's input: from the example, which it scores through the untrusted load
    path to infer the output too; a base of a family that is not built in does not load that way (its
    code loads only on the registry's word, pyfunc.load), so it gets the input signature alone."""
    family = (meta.get("model") or {}).get("family") or integrity.DEFAULT_FAMILY
    optional = [c for c in example.columns if c in OPTIONAL]
    if meta.get("kind") == "base" and family not in ModelConfig.FAMILIES:
        return {"signature": _optional(infer_signature(example), optional)}
    if not optional:
        return {"input_example": example}
    # An optional contract column the family reads (a text family's item_title): in the signature, so
    # evaluation keeps it (registry.model_input), but not required, so a request without it still scores.
    return {
        "input_example": example,
        "signature": _optional(infer_signature(example, np.zeros(len(example), np.float32)), optional),
    }


def _optional(signature, columns: list[str]):
    """`signature` with `columns` of its inputs marked not required."""
    inputs = Schema([ColSpec(c.type, c.name, required=c.name not in columns) for c in signature.inputs.inputs])
    return ModelSignature(inputs=inputs, outputs=signature.outputs, params=signature.params)


def _with_hashes(meta: dict, base_dir: str | None, adapter_dir: str | None) -> dict:
    """meta plus what the files being logged hash to: `adapter_files`, or a base's `fingerprint`
    (recomputed from the files, so the record describes exactly the bytes that are logged)."""
    if meta.get("kind") == "adapter" and adapter_dir:
        return {**meta, "adapter_files": integrity.file_hashes(adapter_dir)}
    if meta.get("kind") == "base" and base_dir:
        from pipelines.model import store  # noqa: PLC0415  torch: status, history read the registry here
        from pipelines.model.base import fingerprint  # noqa: PLC0415  torch: status, history read the registry here

        # the family the caller trained (meta), not whatever the directory's config names
        family = (meta.get("model") or {}).get("family", "feature_transformer")
        return {**meta, "fingerprint": fingerprint(store.load_base(base_dir, family=family))}
    raise RegistryError(
        f"a {meta.get('kind')!r} model is logged with its own directory (base_dir for a base, "
        "adapter_dir for an adapter)"
    )


def register(model_uri: str, name: str, tags: dict, alias: str | None = None, run_id: str | None = None) -> str:
    """Register model_uri as a new version of `name` with tags (and an alias); returns the version.

    The version also gets the logged model's integrity record (`integrity.record`), which is what
    loading it is checked against; a tag in `tags` that contradicts that record is refused. In an Airflow
    task it carries that task instance's `airflow.*` tags too (`runs.airflow_tags`).
    """
    c = client()
    # A tracking server (HTTP) accepts a `models:/m-...` source only together with the logged model's
    # id; a directly opened store accepts either. Passing the id always keeps the lineage link too.
    model_id = _parse_model_id_if_present(model_uri)
    tags = _with_record(
        c, model_id, {**runs.airflow_tags(), **{k: str(v) for k, v in tags.items()}}, f"{name} ({model_uri})"
    )
    try:
        c.get_registered_model(name)
    except Exception:
        try:
            c.create_registered_model(name)
        except Exception:  # created concurrently
            c.get_registered_model(name)
    mv = c.create_model_version(name=name, source=model_uri, run_id=run_id, tags=tags, model_id=model_id)
    if alias:
        c.set_registered_model_alias(name, alias, mv.version)
    return str(mv.version)


def _with_record(c, model_id: str | None, tags: dict[str, str], what: str) -> dict[str, str]:
    """`tags` plus the integrity record of logged model `model_id` (none for models logged before it
    was recorded on logged models, and for sources that are not logged models)."""
    if model_id is None:
        return tags
    recorded = integrity.of_tags(c.get_logged_model(model_id).tags)
    clash = sorted(k for k, v in recorded.items() if tags.get(k) not in (None, "", v))
    if clash:
        raise RegistryError(
            f"{what}: tags {clash} differ from what was recorded when the model was logged "
            f"({', '.join(f'{k}={recorded[k][:24]}' for k in clash)}); refusing to register"
        )
    return {**tags, **recorded}


def version_by_alias(name: str, alias: str):
    """The ModelVersion behind name@alias, or None when the model or alias does not exist. A registry
    that cannot be reached raises (MlflowException): an outage must never read as "no champion"."""
    try:
        return client().get_model_version_by_alias(name, alias)
    except MlflowException as exc:
        if exc.error_code in _ABSENT:
            return None
        raise


def get_version(name: str, version: str):
    try:
        return client().get_model_version(name, str(version))
    except MlflowException as exc:
        if exc.error_code in _ABSENT:
            raise RegistryError(f"{name} version {version} does not exist") from exc
        raise


def download_artifacts(**kwargs) -> str:
    """`mlflow.artifacts.download_artifacts(**kwargs)`, run again when it fails (DOWNLOAD_ATTEMPTS in all,
    ~1 then ~2 s apart): a body cut off mid-stream. An artifact that is really missing fails every
    time and is raised after the last attempt; a bad argument, alias or credential (_FINAL) at once."""
    for attempt in range(1, DOWNLOAD_ATTEMPTS):
        try:
            return mlflow.artifacts.download_artifacts(**kwargs)
        except MlflowException as exc:
            if exc.error_code in _FINAL:
                raise
            wait = 2 ** (attempt - 1) * (0.5 + random.random() / 2)
            log.warning(
                "artifact download %s failed (attempt %d of %d), again in %.1f s: %s",
                kwargs.get("artifact_uri") or kwargs.get("run_id"),
                attempt,
                DOWNLOAD_ATTEMPTS,
                wait,
                str(exc).splitlines()[0],
            )
            time.sleep(wait)
    return mlflow.artifacts.download_artifacts(**kwargs)
