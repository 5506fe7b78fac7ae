"""Release to canary or champion, canary promote / withdraw, human override, and revert refusals, on a
real MLflow store: each move recorded with its kind, op ids make re-runs idempotent."""
from __future__ import annotations

import json

import pytest

from pipelines.config import GatePolicy
from pipelines.errors import PromotionError, RegistryError
from pipelines.promotion import aliases, release
from pipelines.registry import mlflow_io
from tests.pipelines.promotion.test_aliases import MODEL, add_version

FP = "f" * 64
CANARY = GatePolicy(promotion="canary", canary_share=0.2)
DIRECT = GatePolicy(promotion="direct")


@pytest.fixture
def registry(tracking):
    """A serving base (fingerprint FP) and three adapter versions on it: v1, v2 passed, v3 rejected."""
    v = add_version("ctr_base", gate_passed=None, fingerprint=FP)
    mlflow_io.client().set_registered_model_alias("ctr_base", "champion", v)
    return [add_version(MODEL, base__fingerprint=FP), add_version(MODEL, base__fingerprint=FP),
            add_version(MODEL, gate_passed="false", base__fingerprint=FP)]


def kinds(alias="champion") -> list[tuple]:
    return [(e["alias"], e["kind"], e["from_version"], e["to_version"]) for e in aliases.history(MODEL, alias)]


def test_first_release_goes_to_champion_then_candidates_go_to_canary(registry):
    first = release.release(CANARY, MODEL, "1", actor="dag")
    assert first["alias"] == "champion" and first["moved"] and "first run" in first["reason"]
    second = release.release(CANARY, MODEL, "2", actor="dag", op_id="run-2")
    assert second["alias"] == "canary" and second["share"] == 0.2 and aliases.current(MODEL) == "1"
    assert aliases.current(MODEL, "canary") == "2"
    assert mlflow_io.get_version(MODEL, "2").tags[aliases.CANARY_SHARE_TAG] == "0.2"
    again = release.release(CANARY, MODEL, "2", actor="dag", op_id="run-2")   # the task re-run
    assert again["moved"] is False and len(aliases.history(MODEL, None)) == 2

    promoted = aliases.promote_canary(MODEL, reason="3 healthy windows", actor="monitor", op_id="m-1")
    assert promoted["moved"] and aliases.current(MODEL) == "2" and aliases.current(MODEL, "canary") is None
    assert kinds() == [("champion", "promote", "", "1"), ("champion", "promote", "1", "2")]
    assert kinds("canary") == [("canary", "canary", "", "2"), ("canary", "withdraw", "2", "")]
    assert aliases.promote_canary(MODEL, reason="again", actor="monitor", op_id="m-1")["replayed"] is True
    with pytest.raises(PromotionError, match="no @canary"):
        aliases.promote_canary(MODEL, reason="nothing there", actor="monitor")


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
        release.release(CANARY, MODEL, "3", actor="dag")           # a rejected version is never released


def test_override_releases_a_rejected_version_and_is_recorded(registry):
    release.release(DIRECT, MODEL, "1", actor="dag")
    mlflow_io.client().set_model_version_tag(MODEL, "3", "gate.checks", json.dumps(
        [{"name": "base_compatible", "value": FP[:12], "passed": True},
         {"name": "latency_p99_batch32_ms", "value": 61.0, "passed": False}]))
    with pytest.raises(PromotionError, match="needs a reason"):
        release.override(MODEL, "3", reason=" ", actor="alice")
    out = release.override(MODEL, "3", reason="latency measured on a loaded worker", actor="alice", op_id="ui-1")
    assert out["moved"] and out["kind"] == "override" and out["failed_checks"] == ["latency_p99_batch32_ms"]
    assert aliases.current(MODEL) == "3"
    tags = mlflow_io.get_version(MODEL, "3").tags
    assert tags["gate.passed"] == "false"                           # the gate's verdict is kept ...
    assert json.loads(tags["gate.override"])["actor"] == "alice"    # ... and the override sits beside it
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
