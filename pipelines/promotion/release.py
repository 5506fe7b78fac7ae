"""Release a version that passed its gate (or was overridden): to @canary or to @champion.

With `promotion: canary` a passing candidate takes `canary_share` of the users next to the serving
champion, and `ctr_champion_monitor` promotes or withdraws it from live windows. There is nothing to
compare a canary against before the first champion, so a first run is released straight to
@champion (the decision's `first_run` says so). `promotion: direct` always moves @champion.

The entry points the CLI, the flows and the Airflow operators call: `gate_and_release` (the gate,
then the release on a pass), `release` (after a human approval), `record_approval` (that person's
answer, on the version) and `override`. Versions are `str` (see `aliases.version_id`).
"""
from __future__ import annotations

import json
from typing import Callable

from pipelines.config import GatePolicy
from pipelines.errors import PromotionError
from pipelines.promotion import aliases, gate

APPROVAL_TAG = "release.approval"
APPROVAL_ANSWERS = ("Approve", "Reject")
# What a decision says about the move its release made (the full move goes to `on_move`).
RELEASE_KEYS = ("alias", "moved", "from_version", "to_version")


def release(policy: GatePolicy, model: str, version: str, actor: str, op_id: str | None = None,
            approved_by: str | None = None) -> dict:
    champion = aliases.current(model)
    why = f" (approved by {approved_by})" if approved_by else ""
    if policy.promotion == "canary" and champion is not None and champion != version:
        move = aliases.start_canary(model, version, policy.canary_share, actor=actor, op_id=op_id,
                                    reason=f"passed gate against v{champion}: canary at {policy.canary_share:.0%} of "
                                           f"users{why}")
        return {**move, "alias": "canary", "share": policy.canary_share}
    reason = ("passed gate (first run)" if champion is None else f"passed gate against v{champion}") + why
    return {**aliases.promote(model, version, reason=reason, actor=actor, op_id=op_id), "alias": "champion"}


def override(model: str, version: str, reason: str, actor: str, op_id: str | None = None) -> dict:
    """A human releases a rejected version to @champion: recorded on the version and in the history
    as kind "override"; base compatibility is still enforced (gate.override refuses otherwise)."""
    decision = gate.override(model, version, reason, actor)
    # gate.override fetched the version (it exists) and checked its base: the move need not again.
    move = aliases.move_alias(model, "champion", version, kind="override", reason=reason.strip(), actor=actor,
                              op_id=op_id, checked=True)
    return {**move, "alias": "champion", "failed_checks": decision["override"]["failed_checks"]}


def gate_and_release(policy: GatePolicy, model: str, version: str, evaluation: dict, actor: str = "cli",
                     op_id: str | None = None, *, release_on_pass: bool = True,
                     on_move: Callable[[dict], None] | None = None) -> dict:
    """gate.run, then (on a pass) `release`: the one place this sequence is written. Called in-process
    (CLI, flows) and by GatedPromotionOperator, which names its task instance in `op_id` (a retried
    task finds its move instead of moving again) and announces the move through `on_move`.

    `release_on_pass=False`: the gate only (a human approval, then ReleaseOperator, releases).
    Returns the decision with `promoted` (whether @champion moved) and, after a release, `release`.
    """
    decision = gate.run(policy, model, version, evaluation, actor=actor)
    decision["promoted"] = False
    if decision["passed"] and release_on_pass:
        move = release(policy, model, version, actor=actor, op_id=op_id)
        if on_move is not None:
            on_move(move)
        decision["release"] = {k: move.get(k) for k in RELEASE_KEYS}
        decision["promoted"] = bool(move.get("moved")) and move.get("alias") == "champion"
    return decision


def record_approval(model: str, version: str, *, answer: str, by: str, at: str, task: str) -> dict:
    """A person's answer to "release this version?" ("Approve" or "Reject"), who gave it, when and in
    which task: recorded on the version (tag `release.approval`, JSON) whatever the answer."""
    from pipelines.registry import mlflow_io

    if answer not in APPROVAL_ANSWERS:
        raise PromotionError(f"{model} v{version}: approval answer must be one of {APPROVAL_ANSWERS}, got {answer!r}")
    record = {"answer": answer, "by": by, "at": at, "task": task}
    mlflow_io.client().set_model_version_tag(model, version, APPROVAL_TAG, json.dumps(record))
    return record
