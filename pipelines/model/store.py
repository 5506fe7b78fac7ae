"""Checkpoints that store weights + config (safetensors + JSON), for the base model and adapters."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file
from torch import nn

from pipelines.config import ModelConfig, from_dict, to_dict
from pipelines.errors import RegistryError
from pipelines.model import family as families
from pipelines.model.base import fingerprint

WEIGHTS = "weights.safetensors"
CONFIG = "model_config.json"


def save_base(model: nn.Module, directory: str | Path) -> dict:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(d / WEIGHTS))
    meta = {"model": to_dict(model.cfg), "fingerprint": fingerprint(model)}
    (d / CONFIG).write_text(json.dumps(meta, indent=2))
    return meta


def load_base(directory: str | Path, family: str | None = None) -> nn.Module:
    """Load a frozen base model in eval mode; every parameter has requires_grad=False.

    The family its model_config.json names (absent: the default, as every base stored before families
    existed) is built. A family that is not built in is code the loader would import, so it loads only
    when the caller expects exactly that one (`family`, from a record outside the artifact store); any
    other mismatch with `family` is refused too, before anything is imported."""
    d = Path(directory)
    meta = json.loads((d / CONFIG).read_text())
    named = (meta.get("model") or {}).get("family", families.DEFAULT)
    if (family is not None and named != family) or (named not in families.BUILTIN and named != family):
        raise RegistryError(
            f"{d / CONFIG} names model family {named!r}, but {family or 'a built-in family'} "
            "was expected; refusing to load it"
        )
    model = families.resolve(named).build(from_dict(ModelConfig, meta["model"], where=str(d / CONFIG)))
    model.load_state_dict(load_file(str(d / WEIGHTS)))
    model.requires_grad_(False)
    return model.eval()
