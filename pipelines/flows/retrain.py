"""A slot's retrain end to end: train the adapter, evaluate it against the serving champion,
register it with its lineage, then gate and release it.

The ctr_lora_retrain DAG runs these steps as tasks (train, evaluate, register, gate); the CLI
(`train-adapter --register`) runs `run` in one process.
"""
from __future__ import annotations

from pipelines.config import GatePolicy, PipelineConfig
from pipelines.evaluation.compare import evaluate
from pipelines.promotion.release import gate_and_release
from pipelines.registry.register import register
from pipelines.training import adapter


def run(cfg: PipelineConfig, policy: GatePolicy, lake_uri: str, end_day: str, slot: str, *,
        actor: str = "cli", progress: bool = False) -> dict:
    """train -> evaluate -> register -> gate and release; returns the gate's decision.

    In one process nobody can answer an approval: with `approval: true` a passing version stays
    registered and gated, and the release raises PromotionError until a person approves it
    (`python -m pipelines approve`, or the DAG's approval step)."""
    candidate = adapter.train(cfg, lake_uri, end_day, slot, progress=progress)
    registered = register(cfg, candidate, evaluate(cfg, lake_uri, candidate))
    return gate_and_release(policy, registered["model"], registered["version"], registered["evaluation"], actor=actor)
