"""Typed dataclasses from YAML mappings: the machinery under pipelines.config (the schema lives there).

`from_dict` rejects unknown keys and wrong types, so a typo in a YAML file fails loudly instead of
silently falling back to a default; range checks (`check`) run in each dataclass's __post_init__.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from typing import Any, Literal

import yaml

from pipelines.errors import ConfigError


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _coerce(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    if origin is tuple:
        check(isinstance(value, (list, tuple)), f"{where} must be a list, got {type(value).__name__}")
        (inner, _) = typing.get_args(tp)
        return tuple(_coerce(inner, v, f"{where}[]") for v in value)
    if origin is Literal:
        check(value in typing.get_args(tp), f"{where} must be one of {list(typing.get_args(tp))}, got {value!r}")
        return value
    if tp is float:
        check(
            isinstance(value, (int, float)) and not isinstance(value, bool), f"{where} must be a number, got {value!r}"
        )
        return float(value)
    if tp is int:
        check(isinstance(value, int) and not isinstance(value, bool), f"{where} must be an integer, got {value!r}")
        return value
    if tp is str:
        check(isinstance(value, str), f"{where} must be a string, got {value!r}")
        return value
    if tp is bool:
        check(isinstance(value, bool), f"{where} must be true/false, got {value!r}")
        return value
    return value


def from_dict(cls: type, data: dict | None, where: str = "config"):
    """Build dataclass `cls` from a mapping, rejecting unknown keys and wrong types."""
    data = data or {}
    check(isinstance(data, dict), f"{where} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    check(not unknown, f"{where}: unknown keys {unknown} (allowed: {sorted(known)})")
    kwargs = {k: _coerce(hints[k], v, f"{where}.{k}") for k, v in data.items()}
    return cls(**kwargs)


def read_yaml(path: str | os.PathLike) -> dict:
    try:
        with open(path) as fh:
            data = yaml.safe_load(fh) or {}
    except FileNotFoundError as exc:
        raise ConfigError(f"config file not found: {path}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must contain a mapping, got {type(data).__name__}")
    return data


def deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in (over or {}).items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
