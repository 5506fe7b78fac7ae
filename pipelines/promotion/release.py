"""Release a version that passed its gate (or was overridden): to @canary or to @champion.

With `promotion: canary` a passing candidate takes `canary_share` of the users next to the serving
champion, and `ctr_champion_monitor` promotes or withdraws it from live windows. While a canary is
being watched, another passing candidate is held (`canary_in_flight: hold`, nothing moves) or
replaces it. There is nothing to compare a canary against before the first champion, so a first run is released
straight to
@champion (the decision's `first_run` says so). `promotion: direct` always moves @champion. A base
model always goes to @champion (one base serves every adapter), in a move whose reason lists the
serving adapters it makes incompatible.

The policy is enforced here, whoever calls (a DAG, the CLI, a flow): `release` refuses a version
without a recorded "Approve" when the policy says `approval: true`, a version a person rejected (only
`override` releases it, and records the rejection it overrides), and a stale gate: one that compared
against another champion than the one serving now ("stale gate: re-evaluate"). Reading the
champion, checking and moving happen under the model's registry lock, as one step.

The entry points the CLI, the flows and the Airflow operators call: `gate_and_release` (the gate,
then the release on a pass), `release` (after a human approval), `record_approval` (that person's
answer, on the version) and `override`. Versions are `str` (see `aliases.version_id`).
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Callable

from pipelines.config import GatePolicy
from pipelines.errors import PromotionError
from pipelines.promotion import aliases, eligibility, gate_record
from pipelines.promotion.eligibility import APPROVAL_TAG, approval_of
from pipelines.registry import description, mlflow_io
from pipelines.registry.description import HELD_TAG
from pipelines.registry.integrity import FINGERPRINT_TAG
from pipelines.registry.lock import registry_lock
from pipelines.registry.status import adapters_on_other_bases

APPROVAL_ANSWERS = ("Approve", "Reject")
# What a decision says about the move its release made (the full move goes to `on_move`).
RELEASE_KEYS = ("alias", "moved", "from_version", "to_version")
__all__ = ["APPROVAL_TAG", "HELD_TAG", "gate_and_release", "hold_reason", "override", "record_approval", "release"]


def release(policy: GatePolicy, model: str, version: str, actor: str, op_id: str | None = None) -> dict:
    """Release `version` as the policy says, or raise PromotionError saying why not (see the module doc).
    A retried task (same `op_id`) gets its recorded move back, whatever changed since."""
    with registry_lock(model):  # re-entrant: the move takes it again
        replay = aliases.replayed(model, op_id)
        if replay:
            return replay
        mv = mlflow_io.get_version(model, version)  # after the gate and the approval wrote their tags
        champion = aliases.current(model)
        aliases.check_promotable(model, version, mv=mv, require_approval=policy.approval)
        stale = eligibility.stale_refusal(mv.tags, version, champion)
        if stale:
            raise PromotionError(f"release of {model} v{version} refused: {stale}")
        approval = approval_of(mv.tags)
        why = f" (approved by {approval['by']})" if approval and approval["answer"] == "Approve" else ""
        if mv.tags.get(FINGERPRINT_TAG):  # a base: no canary, one base serves every adapter
            return _release_base(policy, model, version, mv, champion, why, actor=actor, op_id=op_id)
        if policy.promotion == "canary" and champion is not None and champion != version:
            held = hold_reason(policy, model, version, champion)
            if held:
                _record_held(model, version, held)
                return {
                    "moved": False,
                    "model": model,
                    "alias": "canary",
                    "from_version": held["canary"],
                    "to_version": held["canary"],
                    "held": True,
                    "held_version": version,
                    "reason": held["reason"],
                }
            move = aliases.start_canary(
                model,
                version,
                policy.canary_share,
                actor=actor,
                op_id=op_id,
                mv=mv,
                require_approval=policy.approval,
                reason=f"passed gate against v{champion}: canary at {policy.canary_share:.0%} of users{why}",
            )
            return {**move, "alias": "canary", "share": policy.canary_share}
        reason = ("passed gate (first run)" if champion is None else f"passed gate against v{champion}") + why
        return {
            **aliases.promote(
                model, version, reason=reason, actor=actor, op_id=op_id, mv=mv, require_approval=policy.approval
            ),
            "alias": "champion",
        }


def hold_reason(policy: GatePolicy, model: str, version: str, champion: str | None) -> dict | None:
    """Why releasing `version` now would be held, and what releases the model again; None when it would not be
    (no canary policy, no champion yet, no other canary watched, or `canary_in_flight: replace`)."""
    if policy.promotion != "canary" or champion is None or champion == version or policy.canary_in_flight != "hold":
        return None
    watched = aliases.current(model, "canary")
    if watched in (None, version):
        return None
    return {
        "canary": watched,
        "reason": (
            f"{model} v{version} passed its gate but is held: canary v{watched} is still being watched next to "
            f"champion v{champion} (canary_in_flight: hold). It is not queued: nothing moves now; once v{watched} "
            "is promoted or withdrawn (ctr_champion_monitor, or ctr_model_ops by hand), the next retrain's "
            "candidate is gated and released in its place"
        ),
    }


def _record_held(model: str, version: str, held: dict) -> None:
    """The hold, on the version (tag `release.held`): the registry says why a passed version does not serve."""
    record = {**held, "at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    mlflow_io.client().set_model_version_tag(model, version, HELD_TAG, json.dumps(record))
    description.publish(model)


def _release_base(
    policy: GatePolicy, model: str, version: str, mv, champion: str | None, why: str, *, actor: str, op_id: str | None
) -> dict:
    """`<base>@champion` moves to a gated base, in one recorded move whose reason lists the serving adapters
    (`@champion`, `@canary`) it makes incompatible: they keep their aliases, are refused by every later
    move and must be retrained on the new base (the next ctr_lora_retrain run trains on it)."""
    stranded = adapters_on_other_bases(model, mv.tags[FINGERPRINT_TAG])
    listed = ", ".join(f"{a['model']}@{a['alias']} v{a['version']}" for a in stranded) or "none"
    head = ("base passed gate (first base)" if champion is None else f"base passed gate against v{champion}") + why
    reason = f"{head}; adapters this base makes incompatible (retrain them): {listed}"
    if len(reason) > aliases.REASON_MAX_CHARS:  # the full list is on the result and in the task log
        reason = reason[: aliases.REASON_MAX_CHARS - 24] + f" ... ({len(stranded)} in all)"
    move = aliases.promote(
        model, version, reason=reason, actor=actor, op_id=op_id, mv=mv, require_approval=policy.approval
    )
    return {**move, "alias": "champion", "incompatible": stranded}


def override(model: str, version: str, reason: str, actor: str, op_id: str | None = None) -> dict:
    """A human releases a version the gate or a person rejected to @champion: recorded on the version
    (`gate.override`: who, why, when, the failed checks and the rejection it goes against) and in the
    history as kind "override"; base compatibility is still enforced (gate_record.override refuses otherwise)."""
    reason = aliases.check_reason(reason, f"override the gate of {model} v{version}")
    decision = gate_record.override(model, version, reason, actor)
    # gate_record.override fetched the version (it exists) and checked its base: the move need not again.
    move = aliases.move_alias(
        model, "champion", version, kind="override", reason=reason, actor=actor, op_id=op_id, checked=True
    )
    return {
        **move,
        "alias": "champion",
        "failed_checks": decision["override"]["failed_checks"],
        "overrides_rejection": decision["override"]["rejection"],
    }


def gate_and_release(
    policy: GatePolicy,
    model: str,
    version: str,
    evaluation: dict,
    actor: str = "cli",
    op_id: str | None = None,
    *,
    release_on_pass: bool = True,
    on_move: Callable[[dict], None] | None = None,
) -> dict:
    """gate_record.run, then (on a pass) `release`: the one place this sequence is written. Called in-process
    (CLI, flows) and by GatedPromotionOperator, which names its task instance in `op_id` (a retried
    task finds its move instead of moving again) and announces the move through `on_move`.

    `release_on_pass=False`: the gate only (a human approval, then ReleaseOperator, releases).
    Returns the decision with `promoted` (whether @champion moved) and, after a release, `release`.
    A pass that may not be released (the policy asks for an approval, the champion changed meanwhile)
    raises `release`'s PromotionError, with the decision already recorded on the version.
    """
    decision = gate_record.run(policy, model, version, evaluation, actor=actor)
    decision["promoted"] = False
    if decision["passed"] and not release_on_pass:  # told before a person approves: the release would be held
        held = hold_reason(policy, model, version, aliases.current(model))
        decision["would_hold"] = held["reason"] if held else None
    if decision["passed"] and release_on_pass:
        move = release(policy, model, version, actor=actor, op_id=op_id)
        if on_move is not None:
            on_move(move)
        decision["release"] = {k: move.get(k) for k in RELEASE_KEYS}
        if move.get("held"):  # passed, not released: a canary is still being watched
            decision["release"].update(held=True, reason=move["reason"])
        if "incompatible" in move:  # a base: the serving adapters it strands
            decision["release"]["incompatible"] = move["incompatible"]
        decision["promoted"] = bool(move.get("moved")) and move.get("alias") == "champion"
    return decision


def record_approval(model: str, version: str, *, answer: str, by: str, at: str, task: str) -> dict:
    """A person's answer to "release this version?" ("Approve" or "Reject"), who gave it, when and in
    which task: recorded on the version (tag `release.approval`, JSON) whatever the answer. `release`
    reads it from there (not from its caller): an answer counts only once it is on the record."""
    if answer not in APPROVAL_ANSWERS:
        raise PromotionError(f"{model} v{version}: approval answer must be one of {APPROVAL_ANSWERS}, got {answer!r}")
    if not isinstance(by, str) or not by.strip():
        raise PromotionError(f"{model} v{version}: an approval answer names who gave it")
    record = {"answer": answer, "by": by, "at": at, "task": task}
    mlflow_io.client().set_model_version_tag(model, version, APPROVAL_TAG, json.dumps(record))
    if answer == "Reject":
        description.reject(model, version, f"rejected by {by} ({task})")
        description.publish(model)
    return record
