"""Checkpoints that store weights + config (safetensors + JSON), for the base model and adapters."""
from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from pipelines.config import ModelConfig, from_dict, to_dict
from pipelines.model.base import CTRModel, fingerprint

WEIGHTS = "weights.safetensors"
CONFIG = "model_config.json"


def save_base(model: CTRModel, directory: str | Path) -> dict:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(d / WEIGHTS))
    meta = {"model": to_dict(model.cfg), "fingerprint": fingerprint(model)}
    (d / CONFIG).write_text(json.dumps(meta, indent=2))
    return meta


def load_base(directory: str | Path) -> CTRModel:
    """Load a frozen base model in eval mode; every parameter has requires_grad=False."""
    d = Path(directory)
    meta = json.loads((d / CONFIG).read_text())
    model = CTRModel(from_dict(ModelConfig, meta["model"], where=str(d / CONFIG)))
    model.load_state_dict(load_file(str(d / WEIGHTS)))
    model.requires_grad_(False)
    return model.eval()
