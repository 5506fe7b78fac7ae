"""Registered models as torch modules: the serving base and adapter versions, loaded and checked.

What the stages read from the registry before they train or score (the serving base, the slot
champions that teach a cold-start student); the pyfunc's own loading is in `registry.pyfunc`.
"""

from __future__ import annotations

from pipelines.config import PipelineConfig
from pipelines.errors import PipelineError
from pipelines.registry import integrity, mlflow_io, pyfunc
from pipelines.registry.pyfunc import load_base_from_registry

BASELINE_ARTIFACT = "baseline_adapter"  # the cold-start baseline's adapter, an artifact of the student's run


def serving_base(cfg: PipelineConfig, *, with_cutoff: bool = False) -> dict:
    """ctr_base@champion: name, version, fingerprint and model family (what adapters are trained on and served with),
    and with `with_cutoff` its training cutoff (the `data.last` tag), which cold start needs."""
    name = cfg.registry.base_model_name
    mv = mlflow_io.version_by_alias(name, "champion")
    if mv is None:
        raise PipelineError(f"no serving base model: {name}@champion is not set; run the ctr_base_model DAG first")

    out = {
        "name": name,
        "version": str(mv.version),
        "fingerprint": mv.tags["fingerprint"],
        "family": integrity.family_of(mv.tags),
    }
    if with_cutoff:
        out["cutoff"] = mv.tags.get("data.last")
        if not out["cutoff"]:
            raise PipelineError(f"{name} v{mv.version} has no data.last tag: its training cutoff is unknown")
    return out


def sibling_champions(
    cfg: PipelineConfig, model_name: str, dst: str, *, base_fingerprint: str | None = None
) -> dict[str, str]:
    """{"<name>:<version>": local adapter directory} of the other slots' @champion adapters (not
    `model_name`'s), downloaded under `dst`. With `base_fingerprint`, only champions trained on that base."""
    out = {}
    for slot in cfg.data.slots:
        name = cfg.adapter_model_name(slot)
        mv = mlflow_io.version_by_alias(name, "champion") if name != model_name else None
        if mv is None or base_fingerprint is not None and mv.tags.get("base.fingerprint") != base_fingerprint:
            continue
        where = mlflow_io.download_artifacts(artifact_uri=f"models:/{name}/{mv.version}", dst_path=f"{dst}/{name}")
        out[f"{name}:{mv.version}"] = f"{where}/artifacts/adapter"
    return out


def load_teachers(cfg: PipelineConfig, slots, refs: dict | None = None, base: dict | None = None) -> tuple[dict, dict]:
    """The teacher of each slot: `ctr_lora_<slot>@champion` (base + adapter), else the serving base.

    Returns ({slot: model, None: serving base}, {slot: ref}). With `refs` (from an earlier task),
    the recorded versions are loaded, not the current aliases, so every task sees the same teacher;
    `base` likewise (default: the serving base).
    """
    base = base or serving_base(cfg, with_cutoff=True)
    models: dict = {None: load_base_from_registry(base["name"], base["version"], base["fingerprint"])}
    out_refs = {}
    for slot in slots:
        name = cfg.adapter_model_name(slot)
        if refs is not None:
            ref = refs[slot]
            version = ref["version"] if ref["kind"] == "adapter" else None
        else:
            mv = mlflow_io.version_by_alias(name, "champion")
            version = str(mv.version) if mv is not None else None
        if version is None:
            models[slot] = models[None]
            out_refs[slot] = {
                "kind": "base",
                "model": base["name"],
                "version": base["version"],
                "data_last": base["cutoff"],
            }
            continue
        mv = mlflow_io.get_version(name, version)
        # the trusted load: the adapter's files are checked against the version's registry tags
        teacher = pyfunc.load(f"models:/{name}/{version}").unwrap_python_model()
        models[slot] = teacher.model
        out_refs[slot] = {
            "kind": "adapter",
            "model": name,
            "version": version,
            "data_last": mv.tags.get("data.last"),
            "base_version": str(teacher.meta["base"]["version"]),
        }
    return models, out_refs
