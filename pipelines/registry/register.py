"""Stage: register an evaluated adapter as a new version of `ctr_lora_<slot>` with full lineage tags.

The version gets alias `candidate`; `@champion` is only ever moved by the gate or an operator.

Registration is idempotent: the version's *registration key* is a hash of what determines the
adapter (model name, data content hash, config hash, code version, base fingerprint). Re-running
the task, or the whole training on the same data, config and code, finds the version carrying that
key and returns it instead of registering a duplicate, first completing what a run killed right after
`create_model_version` left out (its `candidate` alias, its model card: `_complete_registration`).
"""

from __future__ import annotations

import hashlib
import json
import logging

from pipelines.config import PipelineConfig
from pipelines.registry import description, integrity, mlflow_io, model_card
from pipelines.registry.lock import registry_lock

log = logging.getLogger(__name__)

KEY_TAG = "registration.key"


def registration_key(name: str, candidate: dict, code_version: str) -> str:
    ident = {
        "model": name,
        "data": candidate["data"]["sha256"],
        "config": candidate["config_hash"],
        "code": code_version,
        "base": candidate["base"]["fingerprint"],
    }
    siblings = (candidate.get("orthogonality") or {}).get("siblings")
    if siblings:  # trained against these champions (lora.orthogonality_lambda): other siblings, another adapter
        ident["siblings"] = sorted(siblings)
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def lineage_tags(candidate: dict, evaluation: dict, code_version: str | None = None) -> dict:
    d, b = candidate["data"], candidate["base"]
    code = code_version or mlflow_io.code_version()
    run_tags = mlflow_io.client().get_run(candidate["run_id"]).data.tags
    return {
        "slot": candidate["slot"],
        "data.first": d["first"],
        "data.last": d["last"],
        "data.partitions": d["count"],
        "data.sha256": d["sha256"],
        "config.hash": candidate["config_hash"],
        "code.version": code,
        "base.name": b["name"],
        "base.version": b["version"],
        "base.fingerprint": b["fingerprint"],
        "training.run_id": candidate["run_id"],
        # the adapter's file hashes as recorded by the training run when it logged the model
        integrity.TAG: run_tags.get(integrity.TAG, ""),
        "gate.passed": "pending",
        KEY_TAG: registration_key(candidate["model_name"], candidate, code),
        **_evaluation_tags(evaluation, d["last"]),
    }


def _evaluation_tags(evaluation: dict, trained_through: str) -> dict:
    """The holdout evaluation's figures, or for a candidate judged on the next days (`waiting`) its state:
    promotion.prequential judges it on the first validated day after `trained_through`."""
    if evaluation.get("waiting"):
        return {"judge.state": "waiting", "judge.trained_through": trained_through}
    return {
        "eval.candidate": json.dumps(evaluation["candidate"], sort_keys=True),
        "eval.champion": json.dumps(evaluation["champion"], sort_keys=True),
        "eval.champion_version": evaluation["champion_version"] or "",
    }


def find_registered(name: str, key: str):
    """The version of `name` carrying registration key `key`, or None."""
    found = mlflow_io.client().search_model_versions(f"name = '{name}' and tags.`{KEY_TAG}` = '{key}'")
    return min(found, key=lambda mv: int(mv.version)) if found else None


def register(cfg: PipelineConfig, candidate: dict, evaluation: dict) -> dict:
    name = candidate["model_name"]
    tags = lineage_tags(candidate, evaluation)
    existing = find_registered(name, tags[KEY_TAG])
    if existing is not None:
        log.info(
            "%s: data %s, config %s, code %s and base %s are already registered as v%s: returning it",
            name,
            tags["data.sha256"][:12],
            tags["config.hash"][:12],
            tags["code.version"][:12],
            tags["base.fingerprint"][:12],
            existing.version,
        )
        complete_registration(name, str(existing.version), evaluation)
        return {
            "model": name,
            "version": str(existing.version),
            "slot": candidate["slot"],
            "evaluation": evaluation,
            "existing": True,
        }
    with registry_lock(name):  # @candidate moves: a gate rejecting the previous one may be taking it off
        version = mlflow_io.register(candidate["model_uri"], name, tags, alias="candidate", run_id=candidate["run_id"])
        description.publish(name)
    model_card.publish(name, version, evaluation=None if evaluation.get("waiting") else evaluation)
    return {"model": name, "version": version, "slot": candidate["slot"], "evaluation": evaluation, "existing": False}


def complete_registration(name: str, version: str, evaluation: dict) -> None:
    """Finish a registration that a killed process left half done.

    The version with its tags is one write (`create_model_version`), its `candidate` alias and its
    model card are two more: a task killed in between leaves a version nothing points at and with no
    card, and a re-run that only returned the existing version would leave it so for good (issue 13,
    tests/pipelines/flows/test_faults.py). So the re-run completes what is missing, idempotently: the
    alias only while the version still waits for its gate (a gated version has moved on, and a newer
    candidate may hold the alias by now), the card only when the version has none.
    """
    mv = mlflow_io.get_version(name, version)  # with aliases and description (a search may omit them)
    if mv.tags.get("gate.passed") == "pending" and "candidate" not in (mv.aliases or []):
        log.info("%s v%s: registered without its @candidate alias (interrupted): setting it", name, version)
        with registry_lock(name):
            mlflow_io.client().set_registered_model_alias(name, "candidate", version)
    if not (mv.description or "").strip():
        log.info("%s v%s: registered without a model card (interrupted): publishing it", name, version)
        model_card.publish(name, version, evaluation=None if evaluation.get("waiting") else evaluation)
