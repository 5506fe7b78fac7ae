"""Model families (issue 15): what the lifecycle needs to know about the network under the adapters.

A family builds the torch module from the `model` config, turns click-log rows into its input (one
int64 matrix [rows, width]: the streams, the training loop, inference and the batched serving stacks
pass it on untouched), names the modules LoRA targets by default, and loads pretrained weights where it
has them. `model.family` picks one: a built-in name (`BUILTIN`) or `package.module:Factory`, a class or
function that returns a family.

A dotted family is code: `resolve` imports it. Whoever loads a stored base therefore checks the family
its files name against the one expected (`model.store.load_base(..., family=)`) before resolving it,
so a `model_config.json` edited in the artifact store cannot make a loader import a module of its
choice.
"""

from __future__ import annotations

import importlib
from typing import Protocol, runtime_checkable

import numpy as np
import pandas as pd
from torch import nn

from pipelines.config import ModelConfig
from pipelines.data.schema import FEATURE_FIELDS
from pipelines.errors import ConfigError
from pipelines.model import features, text
from pipelines.model.base import CTRModel
from pipelines.model.dcn import DCNModel
from pipelines.model.text import TEXT_COLUMNS, TextCTRModel, load_pretrained

DEFAULT = "feature_transformer"


@runtime_checkable
class Family(Protocol):
    name: str
    default_targets: tuple[str, ...]  # the LoRA target modules of `lora.target_modules` by default

    def build(self, cfg: ModelConfig) -> nn.Module:
        """A new module (random weights) with `.cfg`, `forward(tokens) -> logits [rows]` and
        `logits_and_pooled(tokens) -> (logits, pooled [rows, d])`."""

    def encode(self, frame: pd.DataFrame, cfg: ModelConfig) -> np.ndarray:
        """int64 [rows, width] inputs of the rows of `frame` (click-log contract columns)."""

    def load_pretrained(self, module: nn.Module, cfg: ModelConfig) -> None:
        """Put pretrained weights into `module` before the base is trained (no-op without any)."""

    # Optional (a family without them reads FEATURE_FIELDS, nothing else, and is encoded on every read):
    #   input_columns(cfg) -> tuple[str, ...]     contract columns encode needs (a request without one is refused)
    #   optional_columns(cfg) -> tuple[str, ...]  contract columns encode reads when present
    #   encoding_key(cfg) -> str | None           when set, a part's tokens are cached in the lake under it
    #                                            (model.stream): what the tokens depend on besides the rows


class FeatureTransformer:
    """The project's own network (`model.base.CTRModel`): a hashed token per field, self-attention
    blocks, a logit; trained from scratch on the base window."""

    name = DEFAULT
    default_targets = ("q_proj", "v_proj")

    def build(self, cfg: ModelConfig) -> nn.Module:
        return CTRModel(cfg)

    def encode(self, frame: pd.DataFrame, cfg: ModelConfig) -> np.ndarray:
        return features.encode(frame, cfg)

    def load_pretrained(self, module: nn.Module, cfg: ModelConfig) -> None:
        return None

    def input_columns(self, cfg: ModelConfig) -> tuple[str, ...]:
        return FEATURE_FIELDS

    def optional_columns(self, cfg: ModelConfig) -> tuple[str, ...]:
        return ()

    def encoding_key(self, cfg: ModelConfig) -> str | None:
        return None  # hashing nine fields is cheaper than reading a cache


class DCN(FeatureTransformer):
    """DCN-v2 (`model.dcn.DCNModel`): a cross network and a deep tower over the same field tables and the
    same encoding as the default family; trained from scratch."""

    name = "dcn"
    default_targets = ("cross_proj", "deep_proj")

    def build(self, cfg: ModelConfig) -> nn.Module:
        return DCNModel(cfg)


class MiniLMText(FeatureTransformer):
    """A pretrained sentence transformer (`model.text.TextCTRModel`) reading each impression as words, with a
    CTR head; LoRA on the attention query/value projections. Tokens are cached per lake part."""

    name = "minilm_text"
    default_targets = ("query", "value")

    def build(self, cfg: ModelConfig) -> nn.Module:
        return TextCTRModel(cfg)

    def encode(self, frame: pd.DataFrame, cfg: ModelConfig) -> np.ndarray:
        return text.encode(frame, cfg)

    def load_pretrained(self, module: nn.Module, cfg: ModelConfig) -> None:
        load_pretrained(module, cfg)

    def optional_columns(self, cfg: ModelConfig) -> tuple[str, ...]:
        return TEXT_COLUMNS

    def encoding_key(self, cfg: ModelConfig) -> str | None:
        return text.encoding_key(cfg)


BUILTIN: dict[str, type] = {DEFAULT: FeatureTransformer, "dcn": DCN, "minilm_text": MiniLMText}


def resolve(name: str) -> Family:
    """The family `name` names: a built-in, or `package.module:Factory` imported and called."""
    if name in BUILTIN:
        return BUILTIN[name]()
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(
            f"model.family {name!r} is neither a built-in family {sorted(BUILTIN)} nor 'package.module:Factory'"
        )
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"model.family {name!r}: cannot import it ({type(exc).__name__}: {exc})") from exc
    family = factory()
    missing = [m for m in ("name", "default_targets", "build", "encode", "load_pretrained") if not hasattr(family, m)]
    if missing:
        raise ConfigError(
            f"model.family {name!r} returned {type(family).__name__}, which lacks {missing} "
            "(see pipelines.model.family.Family)"
        )
    return family


def columns(cfg: ModelConfig) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(required, optional) contract columns the family of `cfg` reads."""
    fam = resolve(cfg.family)
    required = fam.input_columns(cfg) if hasattr(fam, "input_columns") else FEATURE_FIELDS
    optional = fam.optional_columns(cfg) if hasattr(fam, "optional_columns") else ()
    return tuple(required), tuple(optional)


def encoding_key(cfg: ModelConfig) -> str | None:
    """The token-cache key of `cfg`'s encoding, None where the family's tokens are not cached."""
    fam = resolve(cfg.family)
    return fam.encoding_key(cfg) if hasattr(fam, "encoding_key") else None


def encode(frame: pd.DataFrame, cfg: ModelConfig) -> np.ndarray:
    """The inputs of `frame`'s rows for a model of config `cfg` (its family's encoding)."""
    return resolve(cfg.family).encode(frame, cfg)


def build(cfg: ModelConfig) -> nn.Module:
    """A new module of the configured family."""
    return resolve(cfg.family).build(cfg)


def of(model: nn.Module) -> Family:
    """The family of a built module (a PEFT-wrapped one too), from its config."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return resolve(base.cfg.family)
