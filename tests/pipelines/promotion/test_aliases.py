"""Promote / revert / history on a real MLflow tracking + registry store (SQLite in tmp_path)."""

from __future__ import annotations

import mlflow
import pytest
from mlflow import MlflowClient

from pipelines.errors import PromotionError, RegistryError
from pipelines.promotion import aliases
from pipelines.registry import history, mlflow_io
from tests.conftest import adapter_tags

MODEL = "ctr_lora_feed"


def add_version(name: str, gate_passed: str | None = "true", lineage: bool = True, **tags) -> str:
    """A registered version with tags (the source is never downloaded in these tests). An adapter (no
    `fingerprint` of its own, no `base__fingerprint` given) records the serving base it was trained on,
    made when the store has none (tests.conftest.adapter_tags), unless `lineage=False`."""
    c = MlflowClient()
    all_tags = {k.replace("__", "."): v for k, v in tags.items()}
    if lineage and not ({"fingerprint", "base.fingerprint"} & set(all_tags)):
        all_tags = adapter_tags(**all_tags)
    try:
        c.get_registered_model(name)
    except Exception:
        c.create_registered_model(name)
    if gate_passed is not None:
        all_tags["gate.passed"] = gate_passed
    return str(c.create_model_version(name, source="file:///tmp/x", tags=all_tags).version)


@pytest.fixture
def three(tracking) -> list[str]:
    """v1 and v2 passed their gate, v3 did not."""
    return [add_version(MODEL), add_version(MODEL), add_version(MODEL, gate_passed="false")]


def champion(name: str = MODEL) -> str | None:
    return aliases.current(name)


# ----------------------------------------------------------------------------- move_alias
def test_move_alias_is_idempotent(three):
    first = aliases.move_alias(MODEL, "champion", "1", kind="promote", reason="first", actor="alice")
    assert first["moved"] is True and first["from_version"] == "" and first["to_version"] == "1"
    assert champion() == "1"
    hist = aliases.history(MODEL)
    assert len(hist) == 1

    again = aliases.move_alias(MODEL, "champion", 1, kind="promote", reason="again", actor="bob")
    assert again["moved"] is False and again["from_version"] == "1" and again["to_version"] == "1"
    assert aliases.history(MODEL) == hist
    assert champion() == "1"


def test_move_alias_rejects_unknown_kind(three):
    with pytest.raises(PromotionError, match="unknown move kind"):
        aliases.move_alias(MODEL, "champion", "1", kind="yolo", reason="r", actor="a")
    assert champion() is None and aliases.history(MODEL) == []


def test_history_is_empty_before_any_move(tracking):
    assert aliases.history("nothing-here") == []
    assert aliases.current("nothing-here") is None


# ----------------------------------------------------------------------------- promote / revert
def test_promote_promote_revert_records_a_full_history(three):
    r1 = aliases.promote(MODEL, "1", reason="first champion", actor="alice")
    assert r1["moved"] is True and champion() == "1"
    r2 = aliases.promote(MODEL, 2, reason="better auc", actor="bob")
    assert r2["moved"] is True and champion() == "2"
    r3 = aliases.revert(MODEL, reason="incident 42", actor="carol")
    assert r3["moved"] is True and champion() == "1"

    hist = aliases.history(MODEL)
    assert [e["kind"] for e in hist] == ["promote", "promote", "revert"]
    assert [(e["from_version"], e["to_version"]) for e in hist] == [("", "1"), ("1", "2"), ("2", "1")]
    assert [e["reason"] for e in hist] == ["first champion", "better auc", "incident 42"]
    assert [e["actor"] for e in hist] == ["alice", "bob", "carol"]
    assert all(e["model"] == MODEL and e["alias"] == "champion" and e["at"] for e in hist)
    assert [int(e["seq"]) for e in hist] == sorted(int(e["seq"]) for e in hist)

    # the history lives as terminated runs in its own experiment, readable with the plain client
    exp = mlflow.get_experiment_by_name(history.HISTORY_EXPERIMENT)
    runs = MlflowClient().search_runs([exp.experiment_id])
    assert len(runs) == 3 and all(r.info.status == "FINISHED" for r in runs)

    # history is per model and per alias
    assert aliases.history(MODEL, alias="canary") == []
    assert aliases.history("ctr_lora_search") == []

    # the alias really points at v1 in the registry
    assert MlflowClient().get_model_version_by_alias(MODEL, "champion").version in ("1", 1)


def test_second_revert_without_an_earlier_champion_is_refused(three):
    aliases.promote(MODEL, "1", reason="r", actor="a")
    aliases.promote(MODEL, "2", reason="r", actor="a")
    aliases.revert(MODEL, reason="back to 1", actor="a")
    n = len(aliases.history(MODEL))
    with pytest.raises(PromotionError, match="no earlier champion"):
        aliases.revert(MODEL, reason="again", actor="a")
    assert champion() == "1" and len(aliases.history(MODEL)) == n


def test_revert_without_any_champion_is_refused(three):
    with pytest.raises(PromotionError, match="no @champion"):
        aliases.revert(MODEL, reason="r", actor="a")


def test_revert_to_a_named_version(three):
    v4 = add_version(MODEL)
    for v in ("1", "2", v4):
        aliases.promote(MODEL, v, reason=f"promote {v}", actor="a")
    out = aliases.revert(MODEL, reason="skip back two", to_version=1, actor="ops")
    assert out["moved"] is True and out["from_version"] == v4 and champion() == "1"
    # the stack pops back to v1: a further default revert has nowhere to go
    with pytest.raises(PromotionError):
        aliases.revert(MODEL, reason="r", actor="a")


def test_revert_to_the_current_champion_is_a_no_op(three):
    aliases.promote(MODEL, "1", reason="r", actor="a")
    out = aliases.revert(MODEL, reason="r", to_version="1", actor="a")
    assert out["moved"] is False and len(aliases.history(MODEL)) == 1


def test_revert_to_an_ungated_version_is_refused_and_alias_untouched(three):
    aliases.promote(MODEL, "1", reason="r", actor="a")
    aliases.promote(MODEL, "2", reason="r", actor="a")
    hist = aliases.history(MODEL)
    with pytest.raises(PromotionError, match=r"v3 never passed its gate.*false"):
        aliases.revert(MODEL, reason="try v3", to_version="3", actor="a")
    assert champion() == "2"
    assert aliases.history(MODEL) == hist


@pytest.mark.parametrize("gate", ["false", "pending", None])
def test_promote_requires_gate_passed_true(tracking, gate):
    v = add_version(MODEL, gate_passed=gate)
    with pytest.raises(PromotionError, match="never passed its gate"):
        aliases.promote(MODEL, v, reason="r", actor="a")
    assert champion() is None and aliases.history(MODEL) == []


def test_promote_a_missing_version_raises_registry_error(three):
    with pytest.raises(RegistryError, match="99"):
        aliases.promote(MODEL, "99", reason="r", actor="a")
    with pytest.raises(RegistryError):
        aliases.promote("no_such_model", "1", reason="r", actor="a")
    assert champion() is None


@pytest.mark.parametrize("reason", ["", "   "])
def test_empty_reason_is_refused(three, reason):
    with pytest.raises(PromotionError, match="reason is required"):
        aliases.promote(MODEL, "1", reason=reason, actor="a")
    assert champion() is None
    aliases.promote(MODEL, "1", reason="ok", actor="a")
    with pytest.raises(PromotionError, match="reason is required"):
        aliases.move_alias(MODEL, "champion", "2", kind="override", reason=reason, actor="a")
    assert champion() == "1"


# ----------------------------------------------------------------------------- base compatibility
def test_version_trained_on_another_base_is_refused(tracking):
    serving_fp, old_fp = "a" * 64, "b" * 64
    base_v = mlflow_io.register("file:///tmp/base", "ctr_base", {"fingerprint": serving_fp}, alias="champion")
    assert mlflow_io.version_by_alias("ctr_base", "champion").version in (base_v, int(base_v))

    good = add_version(MODEL, base__name="ctr_base", base__fingerprint=serving_fp)
    stale = add_version(MODEL, base__name="ctr_base", base__fingerprint=old_fp)

    with pytest.raises(PromotionError, match=r"base fingerprint bbbbbbbbbbbb.*serving base is aaaaaaaaaaaa"):
        aliases.promote(MODEL, stale, reason="r", actor="a")
    assert champion() is None

    assert aliases.promote(MODEL, good, reason="same base", actor="a")["moved"] is True
    assert champion() == good
    # ... and a revert to the incompatible version is refused the same way
    with pytest.raises(PromotionError, match="incompatible"):
        aliases.revert(MODEL, reason="r", to_version=stale, actor="a")
    assert champion() == good


def test_a_version_without_a_base_fingerprint_is_refused_by_every_move(tracking):
    """Issue 13: nobody can say what an adapter computes on the serving base if it does not record the
    base it was trained on (its tag removed, or a version registered by hand)."""
    first, second = add_version(MODEL), add_version(MODEL)
    aliases.promote(MODEL, first, reason="recorded base", actor="a")
    aliases.promote(MODEL, second, reason="recorded base", actor="a")
    bare = add_version(MODEL, lineage=False)
    MlflowClient().delete_model_version_tag(MODEL, first, "base.fingerprint")  # the tag removed afterwards
    for move in (
        lambda: aliases.promote(MODEL, bare, reason="r", actor="a"),
        lambda: aliases.start_canary(MODEL, bare, 0.1, reason="r", actor="a"),
        lambda: aliases.revert(MODEL, reason="back to the first", actor="a"),
    ):
        with pytest.raises(PromotionError, match="records no base fingerprint"):
            move()
    assert champion() == second and aliases.current(MODEL, "canary") is None


def test_version_with_a_base_fingerprint_but_no_serving_base_is_refused(tracking):
    v = add_version(MODEL, base__name="ctr_base", base__fingerprint="c" * 64)
    with pytest.raises(PromotionError, match="missing"):
        aliases.promote(MODEL, v, reason="r", actor="a")
    assert champion() is None


# ----------------------------------------------------------------------------- the version, normalised once
@pytest.mark.parametrize("raw, expected", [(3, "3"), ("3", "3"), (" 12 ", "12"), ("007", "7")])
def test_version_id_is_the_registrys_string(raw, expected):
    assert aliases.version_id(raw) == expected


@pytest.mark.parametrize("raw", [0, -1, "0", "two", "", None, True, "1.5"])
def test_version_id_refuses_what_is_not_a_positive_integer(raw):
    with pytest.raises(PromotionError, match="a model version is a positive integer"):
        aliases.version_id(raw)
