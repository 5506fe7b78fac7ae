"""The days each run reads, and validating them before it reads them.

A DAG's first task validates the window its training reads; the CLI's `train-base`, `train-adapter`
and `cold-start` do the same through `validate_first` (same markers; a day already validated with
the same content and suite is not checked again), and stop with the validation failures if any.
There is no way to skip it: training refuses a day without a `passed` marker anyway
(`data.validated`), this only makes the CLI validate first instead of failing there.
"""

from __future__ import annotations

import datetime as dt

from pipelines.config import PipelineConfig
from pipelines.data.cold import read_days
from pipelines.validation.stage import validate_window


def base_days(cfg: PipelineConfig, cutoff_day: str) -> int:
    """The base model's window: `base_training.train_start` .. the cutoff."""
    return (dt.date.fromisoformat(cutoff_day) - dt.date.fromisoformat(cfg.base_training.train_start)).days + 1


def adapter_days(cfg: PipelineConfig) -> int:
    """An adapter's window: the `lora.window_days` days ending at the run's day."""
    return cfg.lora.window_days


def cold_start_days(cfg: PipelineConfig) -> int:
    """Cold start's history and window (detection counts impressions in the history)."""
    return read_days(cfg)


def validate_first(cfg: PipelineConfig, lake_uri: str, end_day: str, days: int) -> dict:
    """Validate the `days` partitions ending at `end_day`; raises DataValidationError listing every
    failure. Returns the validation summary."""
    return validate_window(cfg, lake_uri, end_day, days)
