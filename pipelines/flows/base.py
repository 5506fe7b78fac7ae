"""The base-model run: train the frozen base on a window, register it, make it the serving base.

The ctr_base_model DAG runs `training.base_model.train` and `register_base` as two tasks; the CLI
(`train-base --register`) runs `run`.
"""
from __future__ import annotations

from pipelines.config import PipelineConfig
from pipelines.promotion import aliases, lock
from pipelines.registry import mlflow_io
from pipelines.training import base_model


def run(cfg: PipelineConfig, lake_uri: str, cutoff_day: str, actor: str = "cli") -> dict:
    """train -> register -> @champion, refusing before training when no registry lock is configured."""
    lock.backend()  # no registry lock to move @champion with: refuse now, not after training
    return register_base(cfg, base_model.train(cfg, lake_uri, cutoff_day), actor=actor)


def register_base(cfg: PipelineConfig, trained: dict, actor: str = "cli") -> dict:
    """Register a trained base (lineage tags) and make it `<base>@champion`."""
    # The new version becomes @champion: without a registry lock (an HTTP tracking server and no
    # CTR_REGISTRY_LOCK_URL) that move is refused, so refuse before registering a version nothing serves.
    lock.backend()
    name = cfg.registry.base_model_name
    tags = {"fingerprint": trained["fingerprint"], "config.hash": trained["config_hash"],
            "code.version": mlflow_io.code_version(), "data.first": trained["data"]["first"],
            "data.last": trained["data"]["last"], "data.sha256": trained["data"]["sha256"],
            "holdout.auc": trained["metrics"]["auc"],
            # The base is promoted on training (no gate yet); gate.passed lets revert accept it.
            "gate.passed": "true", "gate.kind": "direct"}
    version = mlflow_io.register(trained["model_uri"], name, tags, run_id=trained["run_id"])
    move = aliases.move_alias(name, "champion", version, kind="promote", actor=actor,
                              reason=f"base model trained up to {trained['cutoff']}")
    return {"model": name, "version": version, "fingerprint": trained["fingerprint"], "moved": move["moved"],
            "move": move}
