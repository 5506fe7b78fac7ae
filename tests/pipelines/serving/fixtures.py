"""A tiny registry for serving tests: ctr_base@champion + one adapter per synthetic slot.

`build(slots)` fills the MLflow registry that is active (use it after tests.conftest.use_store_copy);
`ServingRegistry.adapter(...)` adds more versions, `tamper` corrupts a stored adapter file in place.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import mlflow
import pandas as pd
import torch

from pipelines.bench import serving_demo as demo
from pipelines.config import LoraTrainConfig, ModelConfig
from pipelines.data.synthetic import SLOTS, SyntheticSpec, generate_day
from pipelines.model.base import CTRModel
from pipelines.registry import mlflow_io

CFG = ModelConfig(id_buckets=64, small_buckets=8, embed_dim=8, n_heads=2, n_blocks=1)
SPEC = SyntheticSpec(n_users=400, n_items=80, n_advertisers=10, new_users_per_day=20, new_items_per_day=5, seed=3)
DAY = "2024-01-10"


def rows(n: int = 300, day: str = DAY) -> pd.DataFrame:
    return pd.concat(list(generate_day(SPEC, day, n)), ignore_index=True)


def adapter_name(slot: str) -> str:
    return f"ctr_lora_{slot}"


@dataclass
class ServingRegistry:
    base: demo.BaseVersion
    base_model: CTRModel
    example: pd.DataFrame
    versions: dict[str, list[str]] = field(default_factory=dict)  # model name -> versions added

    def adapter(
        self,
        slot: str,
        seed: int,
        alias: str | None = "champion",
        name: str | None = None,
        recorded_fingerprint: str | None = None,
        lora_cfg: LoraTrainConfig | None = None,
        on: tuple[demo.BaseVersion, CTRModel] | None = None,
    ) -> str:
        """A new version of `slot`'s adapter, on the first base or `on` (a `new_base()`)."""
        name = name or adapter_name(slot)
        base, base_model = on or (self.base, self.base_model)
        v = demo.add_adapter(
            name,
            slot,
            base,
            base_model,
            self.example,
            seed,
            alias=alias,
            lora_cfg=lora_cfg,
            recorded_fingerprint=recorded_fingerprint,
        )
        self.versions.setdefault(name, []).append(v)
        return v

    def new_base(self, seed: int, alias: str | None = "champion") -> tuple[demo.BaseVersion, CTRModel]:
        """Another ctr_base version (other weights, same config), by default made @champion."""
        torch.manual_seed(seed)
        model = CTRModel(CFG).eval()
        return demo.register_base(model, self.example, alias=alias), model

    def set_alias(self, name: str, alias: str, version: str) -> None:
        mlflow_io.client().set_registered_model_alias(name, alias, version)


def build(slots: tuple[str, ...] = SLOTS, seed: int = 0) -> ServingRegistry:
    torch.manual_seed(seed)
    base_model = CTRModel(CFG).eval()
    example = mlflow_io.input_example(rows(20))
    reg = ServingRegistry(demo.register_base(base_model, example), base_model, example)
    for i, slot in enumerate(slots):
        reg.adapter(slot, seed=100 + i)
    return reg


@contextlib.contextmanager
def request_in_flight(server, frame: pd.DataFrame, monkeypatch) -> Iterator[dict]:
    """A `server.score(frame, return_versions=True)` on another thread, held inside its forward pass
    (its routing table leased) for the body of the `with`; the dict gets its result as "r" on exit."""
    entered, proceed, forward, result = threading.Event(), threading.Event(), server._forward, {}

    def slow_forward(*args):
        entered.set()
        proceed.wait(30)
        return forward(*args)

    monkeypatch.setattr(server, "_forward", slow_forward)
    t = threading.Thread(target=lambda: result.setdefault("r", server.score(frame, return_versions=True)))
    t.start()
    assert entered.wait(30)
    monkeypatch.setattr(server, "_forward", forward)  # later requests run normally
    try:
        yield result
    finally:
        proceed.set()
        t.join(30)


def stored_adapter_file(name: str, version: str, file: str = "adapter_model.safetensors") -> Path:
    """The adapter file as the artifact store holds it (not a downloaded copy)."""
    mv = mlflow_io.get_version(name, version)
    model_id = mv.source.rsplit("/", 1)[-1]
    location = mlflow.get_logged_model(model_id).artifact_location
    path = Path(location.removeprefix("file://")) / "artifacts" / "adapter" / file
    assert path.is_file(), f"expected the stored adapter file at {path}"
    return path


def tamper(name: str, version: str) -> Path:
    """Flip one byte near the end of the stored weights (the tensor data, not the header)."""
    path = stored_adapter_file(name, version)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    return path
