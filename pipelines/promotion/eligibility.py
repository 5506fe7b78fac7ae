"""Who may be released, decided from a version's tags alone (pure): the gate passed, no person rejected it,
the approval the policy asks for is recorded, and the gate compared against the champion that serves now.
Only an override (`gate_record.override`) releases a rejected version. The gate's record
(`gate_record.record`) writes the tags read here; the release (`promotion.release`) and every alias move
(`promotion.aliases`) read them.
"""

from __future__ import annotations

import json

APPROVAL_TAG = "release.approval"  # a person's answer, JSON: answer, by, at, task
APPROVAL_REQUIRED_TAG = "gate.approval_required"  # the policy's `approval` when the gate decided
GATE_CHAMPION_TAG = "gate.champion_version"  # the champion the gate compared against ("" = none)


def approval_of(tags: dict) -> dict | None:
    """The recorded answer on a version's tags; an unreadable record counts as no approval."""
    raw = tags.get(APPROVAL_TAG)
    if not raw:
        return None
    try:
        record = json.loads(raw)
    except ValueError:
        record = None
    if not isinstance(record, dict) or record.get("answer") not in ("Approve", "Reject"):
        return {"answer": "unreadable", "by": "?", "at": "?", "raw": raw[:200]}
    return record


def release_refusal(tags: dict, *, require_approval: bool = False) -> str | None:
    """Why the version with these tags may not serve (None: it may): never passed its gate, rejected by a
    person, or no recorded "Approve" where approval is required (by the policy now, `require_approval`,
    or when it was gated). An override lifts all three: a person released it, on the record."""
    if tags.get("gate.override"):
        return None
    if tags.get("gate.passed") != "true":
        return f"never passed its gate (gate.passed={tags.get('gate.passed', 'missing')}, no override)"
    approval = approval_of(tags)
    if approval and approval["answer"] == "Reject":
        return (
            f"was rejected by {approval['by']} at {approval['at']}: only an override (a named person and a "
            "reason, recorded beside the rejection) can release it"
        )
    if (require_approval or tags.get(APPROVAL_REQUIRED_TAG) == "true") and not (
        approval and approval["answer"] == "Approve"
    ):
        return (
            "needs a recorded approval (gate policy `approval: true`) and has "
            + ("an unreadable one" if approval else "none")
            + ": answer its approve_release step (Airflow) "
            "or `python -m pipelines approve`"
        )
    return None


def stale_refusal(tags: dict, version: str, champion: str | None) -> str | None:
    """ "stale gate" when the champion serving now is not the one the gate compared against (approval can
    take hours; a gate against another champion says nothing about this one). None when it still is, or
    when the version is the champion already (nothing moves)."""
    if champion == version:
        return None
    if GATE_CHAMPION_TAG in tags:
        gated = tags[GATE_CHAMPION_TAG]
    else:  # gated before the tag existed: the evaluation's champion, which the gate compared against
        gated = tags.get("eval.champion_version")
    if gated is None:
        return "stale gate: re-evaluate (the version does not record which champion its gate compared against)"
    if (gated or None) != champion:
        return (
            f"stale gate: re-evaluate (the gate compared against champion {f'v{gated}' if gated else 'none'}, "
            f"the champion is now {f'v{champion}' if champion else 'none'})"
        )
    return None
