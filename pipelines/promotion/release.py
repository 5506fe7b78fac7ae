"""Release a version that passed its gate (or was overridden): to @canary or to @champion.

With `promotion: canary` a passing candidate takes `canary_share` of the users next to the serving
champion, and `ctr_champion_monitor` promotes or withdraws it from live windows. There is nothing to
compare a canary against before the first champion, so a first run is released straight to
@champion (the decision's `first_run` says so). `promotion: direct` always moves @champion.
"""
from __future__ import annotations

from pipelines.config import GatePolicy
from pipelines.promotion import aliases


def release(policy: GatePolicy, model: str, version, actor: str, op_id: str | None = None,
            approved_by: str | None = None) -> dict:
    version = str(version)
    champion = aliases.current(model)
    why = f" (approved by {approved_by})" if approved_by else ""
    if policy.promotion == "canary" and champion is not None and champion != version:
        move = aliases.start_canary(model, version, policy.canary_share, actor=actor, op_id=op_id,
                                    reason=f"passed gate against v{champion}: canary at {policy.canary_share:.0%} of "
                                           f"users{why}")
        return {**move, "alias": "canary", "share": policy.canary_share}
    reason = ("passed gate (first run)" if champion is None else f"passed gate against v{champion}") + why
    return {**aliases.promote(model, version, reason=reason, actor=actor, op_id=op_id), "alias": "champion"}


def override(model: str, version, reason: str, actor: str, op_id: str | None = None) -> dict:
    """A human releases a rejected version to @champion: recorded on the version and in the history
    as kind "override"; base compatibility is still enforced (gate.override refuses otherwise)."""
    from pipelines.promotion import gate

    decision = gate.override(model, version, reason, actor)
    move = aliases.move_alias(model, "champion", str(version), kind="override", reason=reason.strip(), actor=actor,
                              op_id=op_id)
    return {**move, "alias": "champion", "failed_checks": decision["override"]["failed_checks"]}


def gate_and_release(policy: GatePolicy, model: str, version, evaluation: dict, actor: str = "cli") -> dict:
    """The in-process path (CLI, cold_start.run_all): gate.run, then release on a pass."""
    from pipelines.promotion import gate

    decision = gate.run(policy, model, str(version), evaluation, actor=actor)
    decision["promoted"] = False
    if decision["passed"]:
        move = release(policy, model, version, actor=actor)
        decision["release"] = {k: move.get(k) for k in ("alias", "moved", "from_version", "to_version")}
        decision["promoted"] = bool(move.get("moved")) and move.get("alias") == "champion"
    return decision
