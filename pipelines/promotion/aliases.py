"""Alias moves (promote / revert / canary) under the registry lock, each recorded in the durable
alias history (`registry.history`: one run per move in the tracking store).

One move, one record, even when the process dies between the two writes: the record is written
ahead (`pending`), the alias moves, the record is marked `done`; every move (and every retry) first
settles what a dead process left pending, from where the alias points (`_settled`). So `@champion`
is either untouched or moved and recorded, and the history stays one unbroken chain.

A version is a `str` of a positive integer, as the registry returns it: `version_id` is the one
normalisation, applied at the edges (CLI arguments, operator arguments and DAG Params) and where a
version asked for is compared with a recorded one (`move_alias`, `revert`, `promote_canary`).
"""

from __future__ import annotations

from pipelines.errors import PromotionError
from pipelines.promotion.eligibility import release_refusal
from pipelines.promotion.gate import base_check
from pipelines.promotion.gate_record import fingerprints
from pipelines.registry import description, mlflow_io
from pipelines.registry import history as store
from pipelines.registry.history import KINDS, current, history
from pipelines.registry.integrity import FINGERPRINT_TAG
from pipelines.registry.lock import registry_lock

# A reason is an MLflow tag on the history run (8,000 characters at most) and in the override record
# on the version (5,000 at most, with more than the reason in it): a sentence or a ticket link fits.
REASON_MAX_CHARS = 1000


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


def check_reason(reason, what: str) -> str:
    """The reason of a move, stripped; a PromotionError when it is not text, empty or over REASON_MAX_CHARS."""
    if not isinstance(reason, str) or not reason.strip():
        raise PromotionError(f"a reason is required to {what} (got {reason!r})")
    if len(reason.strip()) > REASON_MAX_CHARS:
        raise PromotionError(
            f"a reason is at most {REASON_MAX_CHARS} characters (got {len(reason.strip())}) to "
            f"{what}: it is stored as an MLflow tag; link a ticket for the long story"
        )
    return reason.strip()


def _settled(model: str) -> tuple[list[dict], set[str]]:
    """Every history entry of `model`, after settling those a dead process left pending, and the run ids
    settled `done` just now (caller holds the lock)."""
    found, recovered = store.entries(model), set()
    for i, e in enumerate(found):
        if e["status"] != store.PENDING:
            continue
        now = current(model, e["alias"])
        result = store.outcome(e, now)
        if result is None:
            raise PromotionError(
                f"{model}@{e['alias']} is at v{now}, but its last recorded move (op {e['op_id'] or '-'}"
                f") was v{e['from_version'] or '-'} -> v{e['to_version'] or '-'}: it was moved outside "
                "the registry lock; set it back to one of the two (MLflow UI) and retry"
            )
        found[i] = store.mark(e, result)
        if result == store.DONE:
            recovered.add(e["run_id"])
    return found, recovered


def _replay_of(found: list[dict], recovered: set[str], op_id: str | None) -> dict | None:
    mine = [e for e in store.done(found) if op_id and e["op_id"] == op_id]
    if not mine:
        return None
    # Completed here after its process died: moved as far as the caller knows (it still announces it).
    moved = mine[-1]["run_id"] in recovered
    return {**mine[-1], "moved": moved, "replayed": True, "recovered": moved}


def replayed(model: str, op_id: str | None) -> dict | None:
    """The recorded result of operation `op_id` if it already ran (a retried task must not move twice),
    read after settling pending entries."""
    with registry_lock(model):
        return _replay_of(*_settled(model), op_id)


def move_alias(
    model: str,
    alias: str,
    version,
    *,
    kind: str,
    reason: str,
    actor: str,
    op_id: str | None = None,
    checked: bool = False,
) -> dict:
    """Point model@alias at `version` (None: remove the alias) and record the move, write-ahead.

    Idempotent twice over: a move to where the alias already points is a no-op, and a move whose
    `op_id` (e.g. the Airflow task instance that asked for it) is already recorded is not made again
    (a retried or re-run task returns the recorded move instead of moving the alias a second time).
    `checked`: the caller has just fetched the version (it exists), so it is not fetched again.
    """
    if kind not in KINDS:
        raise PromotionError(f"unknown move kind {kind!r}; expected one of {KINDS}")
    reason = check_reason(reason, f"move {model}@{alias}")
    version = None if version is None else version_id(version)
    if version is not None and not checked:
        mlflow_io.get_version(model, version)  # raises RegistryError if it does not exist
    with registry_lock(model):
        found, recovered = _settled(model)
        replay = _replay_of(found, recovered, op_id)
        if replay:
            description.publish(model)  # the process that moved may have died before it wrote this
            return replay
        before = current(model, alias)
        if before == version:
            return {"moved": False, "model": model, "alias": alias, "from_version": before, "to_version": version}
        last = max((int(e["seq"]) for e in found), default=0)  # rolled-back entries keep their seq
        entry = store.record_intent(model, alias, before, version, kind, reason, actor, op_id=op_id, after_seq=last)
        c = mlflow_io.client()
        if version is None:
            c.delete_registered_model_alias(model, alias)
        else:
            c.set_registered_model_alias(model, alias, version)
        entry = store.mark(entry, store.DONE)
        description.publish(model)
    return {"moved": True, **entry}


def _champion_stack(entries: list[dict]) -> list[str]:
    """Champions in order of succession; a revert pops back to its target."""
    stack: list[str] = []
    for e in entries:
        to = e["to_version"]
        if e["kind"] == "revert" and to in stack:
            del stack[stack.index(to) + 1 :]
        else:
            stack.append(to)
    return stack


def check_promotable(model: str, version: str, *, mv=None, require_approval: bool = False) -> None:
    """Refuse versions that do not exist, never passed a gate, were rejected by a person, lack the
    approval their gate (or `require_approval`, the policy now) asks for (`eligibility.release_refusal`; an
    override lifts these), or, for an adapter, were not trained on the serving base (`gate.base_check`):
    an adapter version that records no base fingerprint is refused too (nobody can say what it computes
    on the serving base). A base version records its own `fingerprint` instead. `mv`: the version, already fetched."""
    mv = mlflow_io.get_version(model, version) if mv is None else mv
    refusal = release_refusal(mv.tags, require_approval=require_approval)
    if refusal:
        raise PromotionError(f"{model} v{version} {refusal}; refusing to release it")
    if mv.tags.get(FINGERPRINT_TAG):  # a base model: what it is compatible with is its own fingerprint
        return
    base = base_check(fingerprints(mv))
    if not base["passed"]:
        if not base["value"]:
            raise PromotionError(
                f"{model} v{version} records no base fingerprint (tag base.fingerprint): the base it "
                "was trained on is unknown; refusing it (retrain it on the serving base)"
            )
        raise PromotionError(
            f"{model} v{version} was trained on base fingerprint {base['value']}..., but the "
            f"serving base is {base['threshold'] or 'missing'}...; refusing an incompatible version"
        )


def promote(
    model: str,
    version: str,
    reason: str,
    actor: str = "cli",
    op_id: str | None = None,
    *,
    require_approval: bool = False,
    mv=None,
) -> dict:
    """`version` becomes @champion, by a person (CLI, ctr_model_ops) or a release: `check_promotable` first."""
    check_reason(reason, f"promote {model} v{version}")
    check_promotable(model, version, mv=mv, require_approval=require_approval)
    return move_alias(model, "champion", version, kind="promote", reason=reason, actor=actor, op_id=op_id, checked=True)


def revert(model: str, reason: str, to_version=None, actor: str = "cli", op_id: str | None = None) -> dict:
    """Put the previous champion (or `to_version`) back as @champion in one step.

    The choice of "previous" and the move happen under the model's registry lock, so two concurrent
    reverts pop the history twice rather than both moving to the same version. A version that does
    not exist, never passed its gate, or whose base is not the serving base is refused.
    """
    check_reason(reason, f"revert {model}")
    with registry_lock(model):  # re-entrant: move_alias takes the same lock inside
        target = _revert_target(model, to_version, op_id)
        if isinstance(target, dict):
            return target
        return move_alias(
            model, "champion", target, kind="revert", reason=reason, actor=actor, op_id=op_id, checked=True
        )


def _revert_target(model: str, to_version, op_id: str | None):
    replay = replayed(model, op_id)  # settles first: "previous" is read from a settled history
    if replay:
        return replay
    now = current(model)
    if now is None:
        raise PromotionError(f"{model} has no @champion to revert")
    if to_version is None:
        to_version = previous_champion(model)
        if to_version is None:
            raise PromotionError(
                f"{model} has no earlier champion to revert to (history: "
                f"{_champion_stack(history(model))}); name a version"
            )
    to_version = version_id(to_version)
    if to_version == now:
        return {"moved": False, "model": model, "alias": "champion", "from_version": now, "to_version": now}
    check_promotable(model, to_version)
    return to_version


# ----------------------------------------------------------------------------- canary
CANARY_SHARE_TAG = "canary.share"


def start_canary(
    model: str,
    version: str,
    share: float,
    reason: str,
    actor: str = "cli",
    op_id: str | None = None,
    *,
    require_approval: bool = False,
    mv=None,
) -> dict:
    """Send `share` of the traffic (users hashed on user_id, see pipelines.serving) to `version` as @canary."""
    if not 0.0 < float(share) < 1.0:
        raise PromotionError(f"canary share must be in (0, 1), got {share}")

    check_reason(reason, f"start a canary of {model} v{version}")
    check_promotable(model, version, mv=mv, require_approval=require_approval)
    # The share is part of the move: written under the lock (re-entrant: move_alias takes it again), so
    # nothing changes when the lock is refused and two concurrent canary starts cannot mix shares.
    with registry_lock(model):
        mlflow_io.client().set_model_version_tag(model, version, CANARY_SHARE_TAG, str(float(share)))
        return move_alias(
            model, "canary", version, kind="canary", reason=reason, actor=actor, op_id=op_id, checked=True
        )


def promote_canary(
    model: str, reason: str, actor: str = "cli", op_id: str | None = None, expected_version: str | None = None
) -> dict:
    """@canary becomes @champion (one recorded promote) and the canary alias is removed (one withdraw;
    returned under "withdrawn"). `expected_version`: refuse if the canary was replaced meanwhile (the
    monitor decided on that version's windows)."""
    with registry_lock(model):
        version = current(model, "canary")
        if expected_version is not None and version is not None and version != version_id(expected_version):
            raise PromotionError(
                f"{model}@canary is v{version}, not v{expected_version}: it was replaced after the "
                "decision; nothing promoted"
            )
        if version is None:
            replay = replayed(model, op_id)
            if replay:
                return replay
            raise PromotionError(f"{model} has no @canary to promote")
        check_promotable(model, version)
        moved = move_alias(
            model, "champion", version, kind="promote", reason=reason, actor=actor, op_id=op_id, checked=True
        )
        withdrawn = move_alias(
            model,
            "canary",
            None,
            kind="withdraw",
            reason=f"promoted to champion: {reason}",
            actor=actor,
            op_id=f"{op_id}/withdraw" if op_id else None,
        )
    return {**moved, "withdrawn": withdrawn}


def previous_champion(model: str) -> str | None:
    """The champion before the current one in order of succession (what a plain revert goes back to)."""
    stack = _champion_stack(history(model))
    return stack[-2] if len(stack) >= 2 else None


def withdraw_canary(model: str, reason: str, actor: str = "cli", op_id: str | None = None) -> dict:
    """Stop the canary: @canary is removed; the champion keeps serving everyone."""
    if current(model, "canary") is None:
        return replayed(model, op_id) or {
            "moved": False,
            "model": model,
            "alias": "canary",
            "from_version": None,
            "to_version": None,
        }
    return move_alias(model, "canary", None, kind="withdraw", reason=reason, actor=actor, op_id=op_id)
