"""The base-model run: train the frozen base on a window, register it as `<base>@candidate`, gate it
against the serving base on the same holdout rows and, when it passes, release it to `@champion`.

A new base is a release like any adapter: the gate (`promotion.gate.decide_base`) and the policy's
approval and stale-gate rules (`promotion.release`) apply, and the move's recorded reason lists the
serving adapters it makes incompatible. The ctr_base_model DAG runs `training.base_model.train`,
`register_candidate` and GatedPromotionOperator as tasks; the CLI (`train-base --register`) and the
tests run `run` / `register_base`, the same steps in one process.
"""

from __future__ import annotations

import json
import logging

from pipelines.config import GatePolicy, PipelineConfig, load_gate_policy
from pipelines.promotion.release import gate_and_release
from pipelines.registry import description, lock, mlflow_io
from pipelines.registry.register import complete_registration
from pipelines.training import base_model

log = logging.getLogger(__name__)


def run(
    cfg: PipelineConfig, lake_uri: str, cutoff_day: str, actor: str = "cli", policy: GatePolicy | None = None
) -> dict:
    """train -> register -> gate -> @champion, refusing before training when no registry lock is configured."""
    lock.backend()  # no registry lock to move @champion with: refuse now, not after training
    return register_base(cfg, base_model.train(cfg, lake_uri, cutoff_day), actor=actor, policy=policy)


def register_base(
    cfg: PipelineConfig, trained: dict, actor: str = "cli", policy: GatePolicy | None = None, op_id: str | None = None
) -> dict:
    """`register_candidate`, then the gate and the release (policy: the gate policy file by default).
    Returns model, version, fingerprint, the decision's `passed` and `moved`, and the `move`."""
    lock.backend()
    registered = register_candidate(cfg, trained)
    moves: list[dict] = []
    decision = gate_and_release(
        policy or load_gate_policy(),
        registered["model"],
        registered["version"],
        registered["evaluation"],
        actor=actor,
        op_id=op_id,
        on_move=moves.append,
    )
    move = moves[0] if moves else {"moved": False}
    return {
        **registered,
        "passed": decision["passed"],
        "moved": bool(move.get("moved")),
        "move": move,
        "incompatible": move.get("incompatible", []),
    }


def register_candidate(cfg: PipelineConfig, trained: dict) -> dict:
    """Register a trained base (lineage tags, its fingerprint, the gate pending) as `<base>@candidate`.

    Idempotent: a version of the base with the same fingerprint (the same weights) is returned as it is,
    so a retried task or a re-run after a crash never registers the same base twice."""
    # The version may become @champion: without a registry lock (an HTTP tracking server and no
    # CTR_REGISTRY_LOCK_URL) that move is refused, so refuse before registering a version nothing serves.
    lock.backend()
    name, fingerprint = cfg.registry.base_model_name, trained["fingerprint"]
    evaluation = trained["evaluation"]
    out = {"model": name, "fingerprint": fingerprint, "evaluation": evaluation}
    found = mlflow_io.client().search_model_versions(f"name = '{name}' and tags.`fingerprint` = '{fingerprint}'")
    if found:
        version = str(min(int(mv.version) for mv in found))
        log.info("%s: fingerprint %s is already registered as v%s: returning it", name, fingerprint[:12], version)
        complete_registration(name, version, evaluation)  # a registration a killed process left half done
        return {**out, "version": version, "existing": True}

    tags = {
        "fingerprint": fingerprint,
        "config.hash": trained["config_hash"],
        "code.version": mlflow_io.code_version(),
        "data.first": trained["data"]["first"],
        "data.last": trained["data"]["last"],
        "data.sha256": trained["data"]["sha256"],
        "holdout.auc": trained["metrics"]["auc"],
        "training.run_id": trained["run_id"],
        "eval.candidate": json.dumps(evaluation["candidate"], sort_keys=True),
        "eval.champion": json.dumps(evaluation["champion"], sort_keys=True),
        "eval.champion_version": evaluation["champion_version"] or "",
        "gate.passed": "pending",
    }
    with lock.registry_lock(name):
        version = mlflow_io.register(trained["model_uri"], name, tags, alias="candidate", run_id=trained["run_id"])
        description.publish(name)
    return {**out, "version": version, "existing": False}
