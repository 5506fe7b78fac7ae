"""Registry side of serving: what an alias names now, and fetching one version with every check done.

Nothing here touches the in-memory model; `router.AdapterServer` decides what to do with the result.
A version that fails a check raises `RefusedVersion` with a machine-readable `reason`:

* ``integrity``: the adapter files do not hash to the version's `adapter.sha256` tag, or the version
  carries no `adapter.sha256` or no `base.fingerprint` (nothing in the registry to check against);
* ``base_mismatch``: the adapter was trained on another base than the one being served;
* ``unsupported``: the adapter carries the base's LayerNorm biases (`lora.train_layernorm_bias`):
  they would overwrite the shared base's and change every other adapter's output (also raised by the
  router for what `serving.batched` does not compute: DoRA and other LoRA variants, LoRA biases);
* ``invalid``: meta.json is missing or not an adapter's, or PEFT cannot load the files;
* ``download``: the artifact store could not be read (the only reason worth retrying).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import mlflow
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from pipelines.errors import RegistryError
from pipelines.model import store
from pipelines.model.adapters import LAYERNORM_BIAS_FILE
from pipelines.model.base import fingerprint
from pipelines.registry import integrity, mlflow_io

CHAMPION, CANARY = "champion", "canary"
Route = tuple[str, str]  # (model, alias): what a routing table maps to a version
RETRYABLE = frozenset({"download"})  # refusal reasons a later refresh tries again
# MLflow's answers for "no such model" and "no such alias": the route is simply absent.
_ABSENT_CODES = frozenset({"RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"})


class Registry:
    """The MLflow tracking + registry a server reads, pinned when it starts (default: the environment's)."""

    def __init__(self, tracking_uri: str | None = None, registry_uri: str | None = None):
        self.tracking_uri = tracking_uri or mlflow.get_tracking_uri()
        self.registry_uri = registry_uri or (mlflow.get_registry_uri() if tracking_uri is None else self.tracking_uri)
        self.client = MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.registry_uri)

    def download(self, uri: str, dst: str | Path) -> Path:
        # retried when a body breaks off mid-stream (MLflow's own retries stop at the response headers)
        return Path(
            mlflow_io.download_artifacts(
                artifact_uri=uri, dst_path=str(dst), tracking_uri=self.tracking_uri, registry_uri=self.registry_uri
            )
        )


@dataclass(frozen=True)
class VersionRef:
    """One registered version, as an alias resolved to it (tags as the registry holds them)."""

    model: str
    version: str
    tags: dict[str, str] = field(default_factory=dict, compare=False, hash=False)
    run_id: str | None = field(default=None, compare=False, hash=False)

    @property
    def key(self) -> str:
        return f"{self.model}:{self.version}"


class RefusedVersion(RegistryError):
    """A version that must not serve; `reason` is one of the module docstring's codes."""

    def __init__(self, ref: VersionRef, reason: str, detail: str):
        self.ref, self.reason, self.detail = ref, reason, detail
        super().__init__(f"{ref.model} v{ref.version} refused ({reason}): {detail}")


def resolve_alias(registry: Registry, model: str, alias: str) -> VersionRef | None:
    """The version behind model@alias, or None when the model or the alias does not exist.

    Any other registry failure raises RegistryError: an unreachable registry must not read as
    "every alias was removed" and unload everything.
    """
    try:
        mv = registry.client.get_model_version_by_alias(model, alias)
    except MlflowException as exc:
        if exc.error_code in _ABSENT_CODES:
            return None
        raise RegistryError(f"cannot resolve {model}@{alias}: {exc}") from exc
    except Exception as exc:  # transport errors of a remote registry are not MlflowExceptions
        raise RegistryError(f"cannot resolve {model}@{alias}: {type(exc).__name__}: {exc}") from exc
    return VersionRef(model, str(mv.version), dict(mv.tags or {}), mv.run_id)


def recorded_hashes(ref: VersionRef) -> str | None:
    """The registry's `adapter.sha256` of a version: its own tag, as resolved with the alias.

    It lives in the registry database, out of reach of whoever can write the artifact store. There is
    no fallback to the training run's tag: a version whose tag is missing (removed, or registered
    without it) is refused, like one whose files differ.
    """
    return ref.tags.get(integrity.TAG) or None


def _download(registry: Registry, ref: VersionRef, subpath: str, dst: str | Path) -> Path:
    try:
        return registry.download(f"models:/{ref.model}/{ref.version}/{subpath}", dst)
    except Exception as exc:
        raise RefusedVersion(ref, "download", f"cannot download {subpath}: {type(exc).__name__}: {exc}") from exc


def _read_meta(ref: VersionRef, local: Path) -> dict:
    path = local / "meta.json"
    try:
        meta = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise RefusedVersion(ref, "invalid", f"unreadable meta.json ({exc})") from exc
    if meta.get("kind") != "adapter" or not isinstance(meta.get("base"), dict):
        raise RefusedVersion(ref, "invalid", f"meta.json is not an adapter's (kind={meta.get('kind')!r})")
    return meta


def _check_base(ref: VersionRef, meta: dict, base_fingerprint: str, base_family: str | None = None) -> None:
    family = ref.tags.get(integrity.FAMILY_TAG)
    if base_family is not None and family is not None and family != base_family:  # the fingerprint implies it;
        raise RefusedVersion(
            ref,
            "base_mismatch",
            f"trained on a {family!r} base, the served base is a "  # this says why
            f"{base_family!r} one",
        )
    if not ref.tags.get("base.fingerprint"):  # meta.json alone is the artifact store's word
        raise RefusedVersion(
            ref,
            "integrity",
            "the version carries no base.fingerprint tag: the base it was "
            "trained on cannot be checked against the registry",
        )
    recorded = {"meta.json": meta["base"].get("fingerprint"), "tag base.fingerprint": ref.tags.get("base.fingerprint")}
    for where, fp in recorded.items():
        if fp is not None and fp != base_fingerprint:
            b = meta["base"]
            raise RefusedVersion(
                ref,
                "base_mismatch",
                f"trained on base {b.get('name')} v{b.get('version')} with fingerprint {fp[:12]}... "
                f"({where}), the served base has {base_fingerprint[:12]}...",
            )
    if recorded["meta.json"] is None:
        raise RefusedVersion(ref, "base_mismatch", "meta.json records no base fingerprint")


def fetch_adapter(
    registry: Registry, ref: VersionRef, base_fingerprint: str, dst: str | Path, base_family: str | None = None
) -> Path:
    """Download `models:/<model>/<version>` adapter files into `dst`, check them (base fingerprint and, with
    `base_family`, the model family its version records), return the adapter dir.

    Only `artifacts/` is fetched (meta.json + adapter files), not the model's copy of the code.
    """
    local = _download(registry, ref, "artifacts", dst)
    meta = _read_meta(ref, local)
    _check_base(ref, meta, base_fingerprint, base_family)
    adapter_dir = local / "adapter"
    try:
        integrity.verify_files(adapter_dir, recorded_hashes(ref), f"{ref.model} v{ref.version}")
    except RegistryError as exc:
        raise RefusedVersion(ref, "integrity", str(exc)) from exc
    if (adapter_dir / LAYERNORM_BIAS_FILE).exists():
        raise RefusedVersion(
            ref,
            "unsupported",
            f"it carries trained LayerNorm biases ({LAYERNORM_BIAS_FILE}), which belong to the "
            "shared base and would change every other adapter's output",
        )
    return adapter_dir


def load_base(registry: Registry, name: str, dst: str | Path):
    """(VersionRef of name@champion, the frozen CTRModel, its fingerprint); see `load_base_version`."""
    ref = resolve_alias(registry, name, CHAMPION)
    if ref is None:
        raise RegistryError(f"no serving base: {name}@{CHAMPION} is not set")
    return (ref, *load_base_version(registry, ref, dst))


def load_base_version(registry: Registry, ref: VersionRef, dst: str | Path):
    """(the frozen model of base version `ref`, its fingerprint); the weights must hash to the version's
    `fingerprint` tag, and a version without one is refused (RegistryError)."""
    try:
        local = _download(registry, ref, "artifacts/base", dst)
    except RefusedVersion as exc:
        raise RegistryError(str(exc)) from exc
    model = store.load_base(local, family=integrity.family_of(ref.tags))
    fp = fingerprint(model)
    what = f"base {ref.model} v{ref.version}"
    integrity.check_fingerprint(fp, integrity.required(ref.tags, integrity.FINGERPRINT_TAG, what), what)
    return model, fp
