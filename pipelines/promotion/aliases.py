"""Alias moves (promote / revert / canary) under the registry lock, each recorded in the durable
alias history (`registry.history`: one run per move in the tracking store).

A version is a `str` of a positive integer, as the registry returns it: `version_id` is the one
normalisation, applied at the edges (CLI arguments, operator arguments and DAG Params) and where a
version asked for is compared with a recorded one (`move_alias`, `revert`, `promote_canary`).
"""
from __future__ import annotations

from pipelines.errors import PromotionError
from pipelines.promotion.gate import base_check, fingerprints
from pipelines.registry import mlflow_io
from pipelines.registry.history import KINDS, current, history, record_move


def version_id(version) -> str:
    """`version` (3, "3", " 3 ") as the registry names it ("3"); a PromotionError for anything that is
    not a positive integer (0, -1, "two", "", None, True)."""
    try:
        n = None if isinstance(version, bool) else int(version)
    except (TypeError, ValueError):
        n = None
    if n is None or n < 1:
        raise PromotionError(f"a model version is a positive integer, got {version!r}")
    return str(n)


def move_alias(model: str, alias: str, version, *, kind: str, reason: str, actor: str,
               op_id: str | None = None, checked: bool = False) -> dict:
    """Point model@alias at `version` (None: remove the alias) and record the move, atomically.

    Idempotent twice over: a move to where the alias already points is a no-op, and a move whose
    `op_id` (e.g. the Airflow task instance that asked for it) is already recorded is not made again
    (a retried or re-run task returns the recorded move instead of moving the alias a second time).
    `checked`: the caller has just fetched the version (it exists), so it is not fetched again.
    """
    from pipelines.promotion.lock import registry_lock

    if kind not in KINDS:
        raise PromotionError(f"unknown move kind {kind!r}; expected one of {KINDS}")
    if not reason or not reason.strip():
        raise PromotionError(f"a reason is required to move {model}@{alias}")
    version = None if version is None else version_id(version)
    if version is not None and not checked:
        mlflow_io.get_version(model, version)  # raises RegistryError if it does not exist
    with registry_lock(model):
        past = history(model, None)
        if op_id:
            done = [e for e in past if e["op_id"] == op_id]
            if done:
                return {"moved": False, "replayed": True, **done[-1]}
        before = current(model, alias)
        if before == version:
            return {"moved": False, "model": model, "alias": alias, "from_version": before, "to_version": version}
        c = mlflow_io.client()
        if version is None:
            c.delete_registered_model_alias(model, alias)
        else:
            c.set_registered_model_alias(model, alias, version)
        entry = record_move(model, alias, before, version, kind, reason, actor, op_id=op_id,
                            after_seq=max((int(e["seq"]) for e in past), default=0))
    return {"moved": True, **entry}


def _champion_stack(entries: list[dict]) -> list[str]:
    """Champions in order of succession; a revert pops back to its target."""
    stack: list[str] = []
    for e in entries:
        to = e["to_version"]
        if e["kind"] == "revert" and to in stack:
            del stack[stack.index(to) + 1:]
        else:
            stack.append(to)
    return stack


def check_promotable(model: str, version: str) -> None:
    """Refuse versions that do not exist, never passed a gate, or were trained on another base than the
    serving one (`gate.base_check`; a version that records no base fingerprint is not checked)."""
    mv = mlflow_io.get_version(model, version)
    if mv.tags.get("gate.passed") != "true" and not mv.tags.get("gate.override"):
        raise PromotionError(f"{model} v{version} never passed its gate (gate.passed="
                             f"{mv.tags.get('gate.passed', 'missing')}, no override); refusing to release it")
    if mv.tags.get("base.fingerprint"):
        base = base_check(fingerprints(mv))
        if not base["passed"]:
            raise PromotionError(f"{model} v{version} was trained on base fingerprint {base['value']}..., but the "
                                 f"serving base is {base['threshold'] or 'missing'}...; refusing an incompatible "
                                 "version")


def promote(model: str, version: str, reason: str, actor: str = "cli", op_id: str | None = None) -> dict:
    check_promotable(model, version)
    return move_alias(model, "champion", version, kind="promote", reason=reason, actor=actor, op_id=op_id,
                      checked=True)


def revert(model: str, reason: str, to_version=None, actor: str = "cli", op_id: str | None = None) -> dict:
    """Put the previous champion (or `to_version`) back as @champion in one step.

    The choice of "previous" and the move happen under the model's registry lock, so two concurrent
    reverts pop the history twice rather than both moving to the same version. A version that does
    not exist, never passed its gate, or whose base is not the serving base is refused.
    """
    from pipelines.promotion.lock import registry_lock

    with registry_lock(model):   # re-entrant: move_alias takes the same lock inside
        target = _revert_target(model, to_version, op_id)
        if isinstance(target, dict):
            return target
        return move_alias(model, "champion", target, kind="revert", reason=reason, actor=actor, op_id=op_id,
                          checked=True)


def _replayed(model: str, op_id: str | None) -> dict | None:
    """The recorded result of operation `op_id` if it already ran (a retried task must not move twice)."""
    done = [e for e in history(model, None) if e["op_id"] == op_id] if op_id else []
    return {"moved": False, "replayed": True, **done[-1]} if done else None


def _revert_target(model: str, to_version, op_id: str | None):
    replay = _replayed(model, op_id)
    if replay:
        return replay
    now = current(model)
    if now is None:
        raise PromotionError(f"{model} has no @champion to revert")
    if to_version is None:
        to_version = previous_champion(model)
        if to_version is None:
            raise PromotionError(f"{model} has no earlier champion to revert to (history: "
                                 f"{_champion_stack(history(model))}); name a version")
    to_version = version_id(to_version)
    if to_version == now:
        return {"moved": False, "model": model, "alias": "champion", "from_version": now, "to_version": now}
    check_promotable(model, to_version)
    return to_version


# ----------------------------------------------------------------------------- canary
CANARY_SHARE_TAG = "canary.share"


def start_canary(model: str, version: str, share: float, reason: str, actor: str = "cli",
                 op_id: str | None = None) -> dict:
    """Send `share` of the traffic (users hashed on user_id, see pipelines.serving) to `version` as @canary."""
    if not 0.0 < float(share) < 1.0:
        raise PromotionError(f"canary share must be in (0, 1), got {share}")
    from pipelines.promotion.lock import registry_lock

    check_promotable(model, version)
    # The share is part of the move: written under the lock (re-entrant: move_alias takes it again), so
    # nothing changes when the lock is refused and two concurrent canary starts cannot mix shares.
    with registry_lock(model):
        mlflow_io.client().set_model_version_tag(model, version, CANARY_SHARE_TAG, str(float(share)))
        return move_alias(model, "canary", version, kind="canary", reason=reason, actor=actor, op_id=op_id,
                          checked=True)


def promote_canary(model: str, reason: str, actor: str = "cli", op_id: str | None = None,
                   expected_version: str | None = None) -> dict:
    """@canary becomes @champion (one recorded promote) and the canary alias is removed (one withdraw;
    returned under "withdrawn"). `expected_version`: refuse if the canary was replaced meanwhile (the
    monitor decided on that version's windows)."""
    from pipelines.promotion.lock import registry_lock

    with registry_lock(model):
        version = current(model, "canary")
        if expected_version is not None and version is not None and version != version_id(expected_version):
            raise PromotionError(f"{model}@canary is v{version}, not v{expected_version}: it was replaced after the "
                                 "decision; nothing promoted")
        if version is None:
            replay = _replayed(model, op_id)
            if replay:
                return replay
            raise PromotionError(f"{model} has no @canary to promote")
        check_promotable(model, version)
        moved = move_alias(model, "champion", version, kind="promote", reason=reason, actor=actor, op_id=op_id,
                           checked=True)
        withdrawn = move_alias(model, "canary", None, kind="withdraw", reason=f"promoted to champion: {reason}",
                               actor=actor, op_id=f"{op_id}/withdraw" if op_id else None)
    return {**moved, "withdrawn": withdrawn}


def previous_champion(model: str) -> str | None:
    """The champion before the current one in order of succession (what a plain revert goes back to)."""
    stack = _champion_stack(history(model))
    return stack[-2] if len(stack) >= 2 else None


def withdraw_canary(model: str, reason: str, actor: str = "cli", op_id: str | None = None) -> dict:
    """Stop the canary: @canary is removed; the champion keeps serving everyone."""
    if current(model, "canary") is None:
        return _replayed(model, op_id) or {"moved": False, "model": model, "alias": "canary", "from_version": None,
                                           "to_version": None}
    return move_alias(model, "canary", None, kind="withdraw", reason=reason, actor=actor, op_id=op_id)
