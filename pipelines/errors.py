"""Typed errors. Each names what failed and where, so a task log line is enough to act on."""

from __future__ import annotations


class PipelineError(Exception):
    """Base class of every error raised on purpose by `pipelines`."""


class ConfigError(PipelineError, ValueError):
    """A config file or value is invalid (unknown key, wrong type, out of range)."""


class LakeError(PipelineError):
    """A lake location cannot be read or written (missing partition, unreadable object)."""


class SchemaError(PipelineError):
    """A frame does not follow the click-log contract."""


class DataValidationError(PipelineError):
    """Data failed its expectation suite; `failures` lists every failed check."""

    def __init__(self, where: str, failures: list[dict]):
        self.where = where
        self.failures = failures
        lines = [f"FAILED {f['check']}: {f.get('observed')} vs {f.get('expected')}" for f in failures]
        super().__init__(f"data validation failed for {where} ({len(failures)} checks):\n" + "\n".join(lines))


class RegistryError(PipelineError):
    """A registry operation is impossible (missing model/version/alias, integrity mismatch)."""


class PromotionError(PipelineError):
    """A promote or revert was refused (e.g. version never passed its gate, incompatible base)."""
