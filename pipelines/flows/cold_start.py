"""The cold-start run end to end: detect -> distill -> evaluate -> register -> gate and release.

The cold-start DAG runs the same steps as tasks (register_stage is its register task); the CLI runs
`run_all` in one process.
"""

from __future__ import annotations

import json

from pipelines.config import PipelineConfig, load_gate_policy
from pipelines.data.cold import ALL
from pipelines.evaluation.cold_start import evaluate_stage
from pipelines.promotion.release import gate_and_release
from pipelines.registry import mlflow_io
from pipelines.registry.register import register
from pipelines.training.cold_start import detect_stage, distill_stage


def register_stage(cfg: PipelineConfig, candidate: dict, evaluation: dict) -> dict:
    """Register the student like any candidate (lineage tags, alias `candidate`) plus the cold-start tags."""
    out = register(cfg, candidate, evaluation)
    c = mlflow_io.client()
    tags = {
        "cold_start": "true",
        "cold_start.cutoff": candidate["cutoff"],
        "cold_start.holdout_start": candidate["holdout_start"],
        "cold_start.teachers": json.dumps(
            {s: f"{r['model']} v{r['version']}" for s, r in candidate["teachers"].items()}, sort_keys=True
        ),
        "cold_start.teacher": candidate["teacher"]["kind"],
        "cold_start.eval": json.dumps(evaluation["cold_slice"], sort_keys=True),
        "cold_start.counts": json.dumps(candidate["cold"], sort_keys=True),
    }
    for k, v in tags.items():
        c.set_model_version_tag(out["model"], out["version"], k, v)
    return out


def run_all(cfg: PipelineConfig, lake_uri: str, end_day: str, slot: str = ALL, policy=None, actor: str = "cli") -> dict:
    """detect -> distill -> evaluate -> register -> gate, in-process (the CLI's path). The release
    follows the policy as everywhere: with `approval: true` it raises PromotionError (see flows.retrain.run)."""
    detected = detect_stage(cfg, lake_uri, end_day, slot)
    candidate = distill_stage(cfg, lake_uri, end_day, slot, detected=detected)
    evaluation = evaluate_stage(cfg, lake_uri, candidate)
    registered = register_stage(cfg, candidate, evaluation)
    decision = gate_and_release(
        policy or load_gate_policy(), registered["model"], registered["version"], evaluation, actor=actor
    )
    return {
        "detected": detected,
        "model": registered["model"],
        "version": registered["version"],
        "evaluation": evaluation,
        "gate": {k: decision[k] for k in ("passed", "first_run", "promoted")},
    }
