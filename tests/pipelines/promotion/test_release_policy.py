"""The release policy is the library's, wherever a move comes from (issue 13, findings 1 and 4): no
release without the approval the policy asks for, a version a person rejected goes out only through
an override (which records the rejection), a gate against another champion than the serving one is
stale, and a reason has a documented length limit. On a real SQLite MLflow store; the CLI as a real
subprocess."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pipelines.config import GatePolicy
from pipelines.errors import PromotionError
from pipelines.promotion import aliases, release
from pipelines.registry import mlflow_io
from tests.pipelines.promotion.test_aliases import MODEL, add_version
from tests.pipelines.promotion.test_gate import POLICY, evaluation

FP = "f" * 64
APPROVAL = GatePolicy(promotion="direct", approval=True)
DIRECT = GatePolicy(promotion="direct")


@pytest.fixture
def versions(tracking):
    """A serving base (FP); v1 and v2 passed their gate as first runs (compared against no champion), v2
    under a policy with `approval: true`; v3 passed against v1."""
    base = add_version("ctr_base", gate_passed=None, fingerprint=FP)
    mlflow_io.client().set_registered_model_alias("ctr_base", "champion", base)
    return [
        add_version(MODEL, base__fingerprint=FP, gate__champion_version=""),
        add_version(MODEL, base__fingerprint=FP, gate__champion_version="", gate__approval_required="true"),
        add_version(MODEL, base__fingerprint=FP, gate__champion_version="1"),
    ]


def answer(version: str, what: str, by: str = "alice") -> dict:
    return release.record_approval(MODEL, version, answer=what, by=by, at="2024-01-05T10:00:00+00:00", task="test")


def untouched() -> bool:
    return aliases.current(MODEL) is None and aliases.history(MODEL, None) == []


# ----------------------------------------------------------------------------- approval
def test_release_refuses_without_a_recorded_approval_when_the_policy_requires_one(versions):
    with pytest.raises(PromotionError, match="needs a recorded approval"):
        release.release(APPROVAL, MODEL, "1", actor="dag", op_id="t-1")
    assert untouched()
    answer("1", "Approve")
    moved = release.release(APPROVAL, MODEL, "1", actor="dag", op_id="t-1")
    assert moved["moved"] and aliases.current(MODEL) == "1"
    assert aliases.history(MODEL)[-1]["reason"] == "passed gate (first run) (approved by alice)"  # from the record


def test_gate_and_release_in_one_process_cannot_skip_the_approval(versions):
    """The CLI's and the flows' path: the gate runs and records, the release is refused."""
    policy = replace(POLICY, approval=True, promotion="direct")
    with pytest.raises(PromotionError, match="needs a recorded approval"):
        release.gate_and_release(policy, MODEL, "1", evaluation(champion=False), actor="cli")
    tags = mlflow_io.get_version(MODEL, "1").tags
    assert tags["gate.passed"] == "true" and tags["gate.approval_required"] == "true" and untouched()


def test_a_version_gated_under_approval_is_refused_by_a_promote_by_hand(versions):
    """ctr_model_ops → promote and `python -m pipelines promote` call aliases.promote: the version's own
    gate asked for an approval (tag), and the policy read now may ask too (`require_approval`)."""
    with pytest.raises(PromotionError, match="v2 needs a recorded approval"):
        aliases.promote(MODEL, "2", reason="looks fine to me", actor="mallory")
    with pytest.raises(PromotionError, match="v1 needs a recorded approval"):
        aliases.promote(MODEL, "1", reason="looks fine to me", actor="mallory", require_approval=True)
    assert untouched()
    answer("2", "Approve")
    assert aliases.promote(MODEL, "2", reason="approved, by hand", actor="alice")["moved"]


def test_a_new_gate_decision_needs_a_new_approval(versions):
    answer("1", "Approve")
    policy = replace(POLICY, approval=True, promotion="direct")
    release.gate_and_release(policy, MODEL, "1", evaluation(champion=False), release_on_pass=False)
    assert release.APPROVAL_TAG not in mlflow_io.get_version(MODEL, "1").tags  # it answered the old decision
    with pytest.raises(PromotionError, match="needs a recorded approval"):
        release.release(policy, MODEL, "1", actor="dag")


def test_an_unreadable_approval_is_no_approval(versions):
    mlflow_io.client().set_model_version_tag(MODEL, "1", release.APPROVAL_TAG, "Approve")  # not the JSON record
    with pytest.raises(PromotionError, match="needs a recorded approval .* has an unreadable one"):
        release.release(APPROVAL, MODEL, "1", actor="dag")


# ----------------------------------------------------------------------------- rejection and override
def test_a_rejected_version_goes_out_only_through_an_override_which_records_the_rejection(versions):
    release.release(DIRECT, MODEL, "1", actor="dag")
    answer("3", "Reject", by="bob")
    for attempt in (
        lambda: release.release(DIRECT, MODEL, "3", actor="dag"),
        lambda: aliases.promote(MODEL, "3", reason="bob was wrong", actor="mallory"),
        lambda: aliases.start_canary(MODEL, "3", 0.1, reason="just a little", actor="mallory"),
        lambda: aliases.revert(MODEL, reason="back to it", to_version="3", actor="mallory"),
    ):
        with pytest.raises(PromotionError, match="v3 was rejected by bob at 2024-01-05T10:00:00"):
            attempt()
    assert aliases.current(MODEL) == "1" and aliases.current(MODEL, "canary") is None
    assert mlflow_io.get_version(MODEL, "3").tags["gate.passed"] == "true"  # the gate's verdict stays

    out = release.override(MODEL, "3", reason="bob's concern is fixed upstream", actor="carol", op_id="ui-9")
    assert out["moved"] and out["kind"] == "override" and aliases.current(MODEL) == "3"
    assert out["overrides_rejection"] == {
        "answer": "Reject",
        "by": "bob",
        "at": "2024-01-05T10:00:00+00:00",
        "task": "test",
    }
    record = json.loads(mlflow_io.get_version(MODEL, "3").tags["gate.override"])
    assert record["actor"] == "carol" and record["rejection"]["by"] == "bob"
    assert [(e["kind"], e["to_version"], e["actor"]) for e in aliases.history(MODEL)][-1] == ("override", "3", "carol")


def test_an_override_is_recorded_without_a_rejection_when_nobody_rejected(versions):
    out = release.override(MODEL, "1", reason="release before the gate reruns", actor="carol")
    assert out["moved"] and out["overrides_rejection"] is None


# ----------------------------------------------------------------------------- stale gate
def test_a_release_is_refused_when_the_champion_changed_since_the_gate(versions):
    release.release(DIRECT, MODEL, "1", actor="dag")
    aliases.move_alias(MODEL, "champion", "2", kind="promote", reason="meanwhile, by hand", actor="ops")
    with pytest.raises(
        PromotionError,
        match=r"stale gate: re-evaluate \(the gate compared against champion v1, "
        r"the champion is now v2\)",
    ):
        release.release(DIRECT, MODEL, "3", actor="dag")
    assert aliases.current(MODEL) == "2"


def test_gate_and_release_refuses_an_evaluation_against_a_champion_that_no_longer_serves(versions):
    release.release(DIRECT, MODEL, "1", actor="dag")
    aliases.move_alias(MODEL, "champion", "2", kind="promote", reason="meanwhile, by hand", actor="ops")
    policy = replace(POLICY, promotion="direct")
    with pytest.raises(PromotionError, match="stale gate: re-evaluate"):
        release.gate_and_release(policy, MODEL, "3", evaluation(version="1"), actor="dag")
    assert mlflow_io.get_version(MODEL, "3").tags["gate.champion_version"] == "1"  # what it compared against
    assert aliases.current(MODEL) == "2"


def test_a_first_run_gate_is_stale_once_something_serves(versions):
    release.release(DIRECT, MODEL, "1", actor="dag")
    answer("2", "Approve")
    with pytest.raises(PromotionError, match="compared against champion none, the champion is now v1"):
        release.release(DIRECT, MODEL, "2", actor="dag")


# ----------------------------------------------------------------------------- reasons
@pytest.mark.parametrize("move", ["promote", "revert", "override", "move_alias"])
def test_a_reason_longer_than_the_limit_is_refused_before_anything_is_written(versions, move):
    release.release(DIRECT, MODEL, "1", actor="dag")
    aliases.move_alias(MODEL, "champion", "3", kind="promote", reason="second", actor="ops")
    n = len(aliases.history(MODEL))
    long = "x" * 2000
    call = {
        "promote": lambda: aliases.promote(MODEL, "2", reason=long, actor="a"),
        "revert": lambda: aliases.revert(MODEL, reason=long, actor="a"),
        "override": lambda: release.override(MODEL, "2", reason=long, actor="a"),
        "move_alias": lambda: aliases.move_alias(MODEL, "champion", "2", kind="promote", reason=long, actor="a"),
    }
    with pytest.raises(PromotionError, match="a reason is at most 1000 characters \\(got 2000\\)"):
        call[move]()
    assert aliases.current(MODEL) == "3" and len(aliases.history(MODEL)) == n
    assert "gate.override" not in mlflow_io.get_version(MODEL, "2").tags


def test_a_reason_at_the_limit_and_a_numeric_reason_are_recorded_as_given(versions):
    aliases.promote(MODEL, "1", reason="12345", actor="a")
    aliases.move_alias(MODEL, "champion", "3", kind="promote", reason="y" * aliases.REASON_MAX_CHARS, actor="a")
    assert [e["reason"] for e in aliases.history(MODEL)] == ["12345", "y" * 1000]
    with pytest.raises(PromotionError, match="a reason is required .* \\(got 12345\\)"):
        aliases.revert(MODEL, reason=12345, actor="a")  # not text: the callers coerce (operators' _text)
