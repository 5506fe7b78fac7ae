"""Fill the active MLflow registry with a base and LoRA adapter versions, as the pipeline registers them.

For the serving benchmarks (`pipelines.bench.serving`, `serving_http`, `families`) and the tests that need
registered versions (tests/pipelines/serving/fixtures.py): it sits with the benchmarks, the layer that
uses it, not in `serving`, which never registers anything. The models
are untrained, but every adapter gets random non-zero LoRA matrices (PEFT initialises lora_B to zero,
which would make every adapter equal the base), so adapters differ from the base and each other.
Logging and tags follow `training.base_model` / `training.adapter` + `registry.register`.
"""

from __future__ import annotations

import copy
import tempfile
from dataclasses import dataclass

import mlflow
import pandas as pd
import torch

from pipelines.config import LoraTrainConfig, to_dict
from pipelines.model import adapters, store
from pipelines.model.base import CTRModel, fingerprint
from pipelines.registry import integrity, mlflow_io

BASE_NAME = "ctr_base"


@dataclass(frozen=True)
class BaseVersion:
    name: str
    version: str
    fingerprint: str

    def ref(self) -> dict:
        return {"name": self.name, "version": self.version, "fingerprint": self.fingerprint}


@dataclass(frozen=True)
class LoggedAdapter:
    """An adapter logged in a run, ready to register (once or several times)."""

    model_uri: str
    run_id: str
    hashes: str  # the run's adapter.sha256 tag (JSON)
    base_fingerprint: str


def register_base(
    model: CTRModel,
    example: pd.DataFrame,
    name: str = BASE_NAME,
    alias: str | None = "champion",
    experiment_id: str | None = None,
) -> BaseVersion:
    fp = fingerprint(model)
    with (
        tempfile.TemporaryDirectory() as tmp,
        mlflow.start_run(run_name=f"{name}-demo", experiment_id=experiment_id) as run,
    ):
        store.save_base(model, tmp)
        info = mlflow_io.log_ctr_model({"kind": "base", "model": to_dict(model.cfg)}, example, base_dir=tmp)
    version = mlflow_io.register(info.model_uri, name, {"fingerprint": fp}, alias=alias, run_id=run.info.run_id)
    return BaseVersion(name, version, fp)


def random_adapter(base: CTRModel, seed: int, lora_cfg: LoraTrainConfig | None = None, scale: float = 0.3):
    """A PeftModel on a copy of `base` whose LoRA A and B matrices are seeded random values."""
    model = adapters.attach(copy.deepcopy(base), lora_cfg or LoraTrainConfig())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return model.eval()


def log_adapter(
    model,
    slot: str,
    base: BaseVersion,
    example: pd.DataFrame,
    recorded_fingerprint: str | None = None,
    experiment_id: str | None = None,
) -> LoggedAdapter:
    """Log `model`'s adapter in a new run. `recorded_fingerprint` overrides the base fingerprint written
    into meta.json and the tags (to build an adapter that claims another base)."""
    base_ref = {**base.ref(), "fingerprint": recorded_fingerprint or base.fingerprint}
    with (
        tempfile.TemporaryDirectory() as tmp,
        mlflow.start_run(run_name=f"adapter-{slot}-demo", experiment_id=experiment_id) as run,
    ):
        adapters.save(model, tmp)
        info = mlflow_io.log_ctr_model({"kind": "adapter", "slot": slot, "base": base_ref}, example, adapter_dir=tmp)
    hashes = mlflow.MlflowClient().get_run(run.info.run_id).data.tags[integrity.TAG]
    return LoggedAdapter(info.model_uri, run.info.run_id, hashes, base_ref["fingerprint"])


def register_adapter(
    logged: LoggedAdapter, name: str, slot: str, alias: str | None = None, base: BaseVersion | None = None
) -> str:
    tags = {"slot": slot, "base.fingerprint": logged.base_fingerprint, integrity.TAG: logged.hashes}
    if base is not None:
        tags.update({"base.name": base.name, "base.version": base.version})
    return mlflow_io.register(logged.model_uri, name, tags, alias=alias, run_id=logged.run_id)


def add_adapter(
    name: str,
    slot: str,
    base: BaseVersion,
    base_model: CTRModel,
    example: pd.DataFrame,
    seed: int,
    alias: str | None = "champion",
    lora_cfg: LoraTrainConfig | None = None,
    recorded_fingerprint: str | None = None,
) -> str:
    """Train-free adapter version: random LoRA weights, logged and registered; returns the version."""
    logged = log_adapter(random_adapter(base_model, seed, lora_cfg), slot, base, example, recorded_fingerprint)
    return register_adapter(logged, name, slot, alias=alias, base=base)
