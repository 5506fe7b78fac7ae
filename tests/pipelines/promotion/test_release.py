"""Release to canary or champion, canary promote / withdraw, human override, and revert refusals, on a
real MLflow store: each move recorded with its kind, op ids make re-runs idempotent. gate_and_release
(the one gate-then-release pass) and record_approval (a person's answer on the version)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pipelines.config import GatePolicy
from pipelines.errors import PromotionError, RegistryError
from pipelines.promotion import aliases, release
from pipelines.registry import mlflow_io
from tests.pipelines.promotion.test_aliases import MODEL, add_version
from tests.pipelines.promotion.test_gate import POLICY, evaluation

FP = "f" * 64
CANARY = GatePolicy(promotion="canary", canary_share=0.2)
DIRECT = GatePolicy(promotion="direct")


@pytest.fixture
def registry(tracking):
    """A serving base (fingerprint FP) and three adapter versions on it: v1 passed (first run), v2
    passed against v1, v3 rejected."""
    v = add_version("ctr_base", gate_passed=None, fingerprint=FP)
    mlflow_io.client().set_registered_model_alias("ctr_base", "champion", v)
    return [
        add_version(MODEL, base__fingerprint=FP, gate__champion_version=""),
        add_version(MODEL, base__fingerprint=FP, gate__champion_version="1"),
        add_version(MODEL, gate_passed="false", base__fingerprint=FP),
    ]


def kinds(alias="champion") -> list[tuple]:
    return [(e["alias"], e["kind"], e["from_version"], e["to_version"]) for e in aliases.history(MODEL, alias)]


def test_first_release_goes_to_champion_then_candidates_go_to_canary(registry):
    first = release.release(CANARY, MODEL, "1", actor="dag")
    assert first["alias"] == "champion" and first["moved"] and "first run" in first["reason"]
    second = release.release(CANARY, MODEL, "2", actor="dag", op_id="run-2")
    assert second["alias"] == "canary" and second["share"] == 0.2 and aliases.current(MODEL) == "1"
    assert aliases.current(MODEL, "canary") == "2"
    assert mlflow_io.get_version(MODEL, "2").tags[aliases.CANARY_SHARE_TAG] == "0.2"
    again = release.release(CANARY, MODEL, "2", actor="dag", op_id="run-2")  # the task re-run
    assert again["moved"] is False and len(aliases.history(MODEL, None)) == 2

    promoted = aliases.promote_canary(MODEL, reason="3 healthy windows", actor="monitor", op_id="m-1")
    assert promoted["moved"] and aliases.current(MODEL) == "2" and aliases.current(MODEL, "canary") is None
    assert kinds() == [("champion", "promote", "", "1"), ("champion", "promote", "1", "2")]
    assert kinds("canary") == [("canary", "canary", "", "2"), ("canary", "withdraw", "2", "")]
    assert aliases.promote_canary(MODEL, reason="again", actor="monitor", op_id="m-1")["replayed"] is True
    with pytest.raises(PromotionError, match="no @canary"):
        aliases.promote_canary(MODEL, reason="nothing there", actor="monitor")


def test_a_pass_while_a_canary_is_watched_is_held_unless_the_policy_says_replace(registry):
    release.release(CANARY, MODEL, "1", actor="dag")
    release.release(CANARY, MODEL, "2", actor="dag")
    v4 = add_version(MODEL, base__fingerprint=FP, gate__champion_version="1")
    assert CANARY.canary_in_flight == "hold"  # the default: daily retrains would otherwise restart every watch
    held = release.release(CANARY, MODEL, v4, actor="dag")
    assert held["moved"] is False and held["held"] and held["held_version"] == v4
    assert "canary v2 is still being watched" in held["reason"] and "It is not queued" in held["reason"]
    assert "once v2 is promoted or withdrawn" in held["reason"]  # what releases the model again
    record = json.loads(mlflow_io.get_version(MODEL, v4).tags[release.HELD_TAG])  # the registry says so too
    assert record["canary"] == "2" and record["reason"] == held["reason"] and record["at"]
    assert aliases.current(MODEL, "canary") == "2" and len(aliases.history(MODEL, "canary")) == 1
    replaced = release.release(replace(CANARY, canary_in_flight="replace"), MODEL, v4, actor="dag")
    assert replaced["moved"] and aliases.current(MODEL, "canary") == v4
    aliases.withdraw_canary(MODEL, reason="canary AUC below the champion's", actor="monitor")
    assert release.release(CANARY, MODEL, v4, actor="dag")["moved"]  # nothing watched: released
    assert aliases.current(MODEL, "canary") == v4


def test_direct_policy_moves_the_champion(registry):
    release.release(DIRECT, MODEL, "1", actor="dag")
    moved = release.release(DIRECT, MODEL, "2", actor="dag")
    assert moved["alias"] == "champion" and aliases.current(MODEL) == "2" and aliases.current(MODEL, "canary") is None


def test_withdrawn_canary_leaves_the_champion_serving(registry):
    release.release(CANARY, MODEL, "1", actor="dag")
    release.release(CANARY, MODEL, "2", actor="dag")
    w = aliases.withdraw_canary(MODEL, reason="canary AUC 0.61 < champion 0.70 - 0.005", actor="monitor")
    assert w["moved"] and aliases.current(MODEL, "canary") is None and aliases.current(MODEL) == "1"
    assert aliases.withdraw_canary(MODEL, reason="again", actor="monitor")["moved"] is False
    with pytest.raises(PromotionError, match="never passed its gate"):
        release.release(CANARY, MODEL, "3", actor="dag")  # a rejected version is never released


def test_override_releases_a_rejected_version_and_is_recorded(registry):
    release.release(DIRECT, MODEL, "1", actor="dag")
    mlflow_io.client().set_model_version_tag(
        MODEL,
        "3",
        "gate.checks",
        json.dumps(
            [
                {"name": "base_compatible", "value": FP[:12], "passed": True},
                {"name": "latency_p99_batch32_ms", "value": 61.0, "passed": False},
            ]
        ),
    )
    with pytest.raises(PromotionError, match="a reason is required to override"):
        release.override(MODEL, "3", reason=" ", actor="alice")
    out = release.override(MODEL, "3", reason="latency measured on a loaded worker", actor="alice", op_id="ui-1")
    assert out["moved"] and out["kind"] == "override" and out["failed_checks"] == ["latency_p99_batch32_ms"]
    assert aliases.current(MODEL) == "3"
    tags = mlflow_io.get_version(MODEL, "3").tags
    assert tags["gate.passed"] == "false"  # the gate's verdict is kept ...
    assert json.loads(tags["gate.override"])["actor"] == "alice"  # ... and the override sits beside it
    assert kinds()[-1] == ("champion", "override", "1", "3")
    assert aliases.history(MODEL)[-1]["reason"] == "latency measured on a loaded worker"


def test_override_can_never_skip_base_compatibility(registry):
    other = add_version(MODEL, gate_passed="false", base__fingerprint="0" * 64)
    with pytest.raises(PromotionError, match="no override skips this check"):
        release.override(MODEL, other, reason="I know what I am doing", actor="mallory")
    assert aliases.current(MODEL) is None and aliases.history(MODEL) == []
    assert "gate.override" not in mlflow_io.get_version(MODEL, other).tags


def test_revert_refusals_name_what_is_wrong(registry):
    release.release(DIRECT, MODEL, "1", actor="dag")
    release.release(DIRECT, MODEL, "2", actor="dag")
    with pytest.raises(RegistryError, match="version 99 does not exist"):
        aliases.revert(MODEL, reason="typo", to_version="99")
    with pytest.raises(PromotionError, match="v3 never passed its gate"):
        aliases.revert(MODEL, reason="bad", to_version="3")
    incompatible = add_version(MODEL, base__fingerprint="0" * 64)
    with pytest.raises(PromotionError, match="trained on base fingerprint 000000000000"):
        aliases.revert(MODEL, reason="old base", to_version=incompatible)
    assert aliases.current(MODEL) == "2"
    back = aliases.revert(MODEL, reason="incident 7", actor="oncall", op_id="ui-revert-7")
    assert back["moved"] and aliases.current(MODEL) == "1"
    assert aliases.revert(MODEL, reason="incident 7", actor="oncall", op_id="ui-revert-7")["replayed"] is True
    assert aliases.current(MODEL) == "1" and kinds()[-1] == ("champion", "revert", "2", "1")


# ----------------------------------------------------------------------------- gate_and_release
GATED = replace(POLICY, promotion="canary", canary_share=0.2)


def test_gate_and_release_gates_then_releases_under_the_callers_op_id(registry):
    moves = []
    first = release.gate_and_release(
        GATED, MODEL, "1", evaluation(champion=False), actor="dag", op_id="task-1", on_move=moves.append
    )
    assert first["passed"] and first["first_run"] and first["promoted"] is True and first["version"] == "1"
    assert first["release"] == {"alias": "champion", "moved": True, "from_version": "", "to_version": "1"}
    assert [(m["alias"], m["kind"], m["op_id"], m["actor"]) for m in moves] == [
        ("champion", "promote", "task-1", "dag")
    ]
    assert mlflow_io.get_version(MODEL, "1").tags["gate.passed"] == "true"

    again = release.gate_and_release(
        GATED, MODEL, "1", evaluation(champion=False), actor="dag", op_id="task-1", on_move=moves.append
    )  # the task retried: the recorded move, no second one
    assert again["promoted"] is False and again["release"]["moved"] is False and moves[-1]["replayed"] is True
    assert len(aliases.history(MODEL, None)) == 1

    second = release.gate_and_release(GATED, MODEL, "2", evaluation(version="1"), actor="dag", op_id="task-2")
    assert second["passed"] and second["promoted"] is False and second["release"]["alias"] == "canary"
    assert aliases.current(MODEL) == "1" and aliases.current(MODEL, "canary") == "2"


def test_gate_and_release_without_release_or_on_a_rejection_moves_nothing(registry):
    moves = []
    gated = release.gate_and_release(
        GATED, MODEL, "1", evaluation(champion=False), actor="dag", release_on_pass=False, on_move=moves.append
    )  # a human approves first
    assert gated["passed"] and gated["promoted"] is False and "release" not in gated
    rejected = release.gate_and_release(
        GATED, MODEL, "2", evaluation(cand_auc=0.55, champion=False), actor="dag", on_move=moves.append
    )
    assert rejected["passed"] is False and rejected["promoted"] is False and "release" not in rejected
    assert moves == [] and aliases.current(MODEL) is None and aliases.history(MODEL, None) == []
    assert mlflow_io.get_version(MODEL, "2").tags["gate.passed"] == "false"


def test_one_gate_and_release_pass_fetches_the_version_twice(registry, monkeypatch):
    """Once for the gate (base fingerprint, training run), once for the release's own check (the gate
    has just changed its tags); the move itself does not fetch it again."""
    fetched, get_version = [], mlflow_io.get_version
    monkeypatch.setattr(mlflow_io, "get_version", lambda name, v: fetched.append((name, v)) or get_version(name, v))
    release.gate_and_release(GATED, MODEL, "1", evaluation(champion=False), actor="dag")
    assert fetched == [(MODEL, "1"), (MODEL, "1")] and aliases.current(MODEL) == "1"


# ----------------------------------------------------------------------------- record_approval
def test_an_approval_answer_is_recorded_on_the_version_whatever_it_is(registry):
    for version, answer in (("1", "Approve"), ("2", "Reject")):
        record = release.record_approval(
            MODEL,
            version,
            answer=answer,
            by="alice",
            at="2024-01-05T10:00:00+00:00",
            task="airflow:ctr_lora_retrain/r/approval.release[0]",
        )
        tag = mlflow_io.get_version(MODEL, version).tags[release.APPROVAL_TAG]
        assert (
            json.loads(tag)
            == record
            == {
                "answer": answer,
                "by": "alice",
                "at": "2024-01-05T10:00:00+00:00",
                "task": "airflow:ctr_lora_retrain/r/approval.release[0]",
            }
        )
    with pytest.raises(PromotionError, match="approval answer must be one of"):
        release.record_approval(MODEL, "3", answer="Maybe", by="bob", at="", task="t")
    assert release.APPROVAL_TAG not in mlflow_io.get_version(MODEL, "3").tags
    assert aliases.current(MODEL) is None  # an answer is a record, not a move


def test_a_candidate_waiting_for_approval_is_told_before_that_its_release_would_be_held(registry):
    """The approval's body reads `would_hold` (ctr_airflow.approval): the person approving knows it will not move."""
    release.release(CANARY, MODEL, "1", actor="dag")
    release.release(CANARY, MODEL, "2", actor="dag")  # v2 is the canary being watched
    v4 = add_version(MODEL, base__fingerprint=FP, gate__champion_version="1")
    gated = release.gate_and_release(GATED, MODEL, v4, evaluation(version="1"), actor="dag", release_on_pass=False)
    assert gated["passed"] and "held: canary v2 is still being watched" in gated["would_hold"]
    free = release.gate_and_release(
        replace(GATED, canary_in_flight="replace"),
        MODEL,
        v4,
        evaluation(version="1"),
        actor="dag",
        release_on_pass=False,
    )
    assert free["would_hold"] is None
