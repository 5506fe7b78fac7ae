"""One move, one record, even under a crash (issue 13, finding 4): a promote is killed with SIGKILL in
its own process between the write-ahead entry and the alias move, or between the alias move and its
record, with the registry lock held. Then a retry of the same operation or the next move of the model
settles it: `@champion` is either untouched or moved and recorded, the history is one unbroken
chain, and a revert computed from it goes to the right version. Real processes, real SQLite and
PostgreSQL stores (PostgreSQL when reachable)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient

from pipelines.errors import PromotionError
from pipelines.promotion import aliases
from pipelines.registry import history
from pipelines.registry.status import format_status, model_status
from tests.conftest import kill_at_marker
from tests.pipelines.promotion.test_aliases import MODEL, add_version

REPO = Path(__file__).resolve().parents[3]


def kill_during_promote(uri: str, version: str, op_id: str, point: str, tmp: Path) -> None:
    """Run aliases.promote in a child process, SIGKILL it at `point` (see crash_move)."""
    marker = tmp / f"at-{point}-{op_id}"
    kill_at_marker(
        [sys.executable, "-m", "tests.pipelines.promotion.crash_move", uri, MODEL, version, op_id, point, str(marker)],
        marker,
        what="the move",
        cwd=REPO,
        env={**os.environ, "MLFLOW_TRACKING_URI": uri},
        timeout_s=180,
    )


def chain(alias: str = "champion") -> list[tuple[str, str, str]]:
    """(kind, from, to) of the recorded moves, after checking they form one unbroken chain."""
    entries = aliases.history(MODEL, alias)
    for before, after in zip(entries, entries[1:]):
        assert after["from_version"] == before["to_version"], f"broken chain: {before} then {after}"
    return [(e["kind"], e["from_version"], e["to_version"]) for e in entries]


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tracking, store_uri):
    """(tracking URI) with v1..v3 passed and v1 serving: the copied SQLite store, or a fresh PostgreSQL one."""
    uri = tracking
    if request.param == "postgresql":
        if not store_uri.startswith("postgresql"):
            pytest.skip("PostgreSQL is not reachable")
        uri = store_uri
        MlflowClient(tracking_uri=uri).search_experiments()  # create the schema
        mlflow.set_tracking_uri(uri)
        os.environ["MLFLOW_TRACKING_URI"] = uri  # restored by the tracking fixture's monkeypatch
    for _ in range(3):
        add_version(MODEL)
    aliases.promote(MODEL, "1", reason="first champion", actor="alice")
    return uri


@pytest.mark.slow
@pytest.mark.parametrize("point", ["before_alias", "after_alias"])
def test_a_retry_after_a_kill_completes_or_rolls_back_the_move(store, tmp_path, point):
    kill_during_promote(store, "2", "op-2", point, tmp_path)
    moved = point == "after_alias"
    assert aliases.current(MODEL) == ("2" if moved else "1")  # the registry as the dead process left it
    assert chain() == [("promote", "", "1")]  # nothing recorded as done yet

    again = aliases.promote(MODEL, "2", reason="crash test op-2", actor="retry", op_id="op-2")  # the task's retry
    assert aliases.current(MODEL) == "2" and again["to_version"] == "2" and again["moved"] is True
    assert again.get("recovered", False) is moved  # completed, not moved a second time
    assert chain() == [("promote", "", "1"), ("promote", "1", "2")]
    assert aliases.previous_champion(MODEL) == "1"
    statuses = [e["status"] for e in history.entries(MODEL)]
    assert statuses == (["done", "done"] if moved else ["done", "rolled_back", "done"])
    assert aliases.promote(MODEL, "2", reason="again", actor="retry", op_id="op-2")["replayed"] is True


@pytest.mark.slow
@pytest.mark.parametrize("point", ["before_alias", "after_alias"])
def test_the_next_move_settles_a_killed_move_and_reverts_from_the_right_history(tracking, tmp_path, point):
    for _ in range(3):
        add_version(MODEL)
    aliases.promote(MODEL, "1", reason="first champion", actor="alice")
    kill_during_promote(tracking, "2", "op-2", point, tmp_path)
    assert aliases.current(MODEL) == ("2" if point == "after_alias" else "1")

    shown = model_status(MODEL)  # what `python -m pipelines status` shows until the next move
    assert [(e["op_id"], e["to_version"]) for e in shown["pending"]] == [("op-2", "2")]
    assert "PENDING:" in format_status([shown]) and [e["to_version"] for e in shown["history"]] == ["1"]

    if point == "after_alias":  # v2 served: the revert goes back from it to v1, and the history says so
        back = aliases.revert(MODEL, reason="incident after the crash", actor="oncall")
        assert back["moved"] and aliases.current(MODEL) == "1"
        assert chain() == [("promote", "", "1"), ("promote", "1", "2"), ("revert", "2", "1")]
    else:  # v2 never served: there is nothing to revert to, and nothing moves
        with pytest.raises(PromotionError, match="no earlier champion"):
            aliases.revert(MODEL, reason="incident after the crash", actor="oncall")
        assert aliases.current(MODEL) == "1" and chain() == [("promote", "", "1")]
        aliases.promote(MODEL, "3", reason="next release", actor="bob")
        assert chain() == [("promote", "", "1"), ("promote", "1", "3")]
    assert history.pending(MODEL) == []
    assert [e["status"] for e in history.entries(MODEL) if e["op_id"] == "op-2"] == (
        ["done"] if point == "after_alias" else ["rolled_back"]
    )


def test_an_alias_moved_outside_the_lock_stops_every_move_until_a_person_looks(tracking):
    """A pending entry whose alias is neither where it came from nor where it went: the registry was
    changed by hand. Guessing either way would break the chain, so moves refuse, naming what to fix."""
    for _ in range(3):
        add_version(MODEL)
    aliases.promote(MODEL, "1", reason="first", actor="a")
    history.record_intent(MODEL, "champion", "1", "2", "promote", "dies here", "doomed", op_id="op-x", after_seq=0)
    MlflowClient().set_registered_model_alias(MODEL, "champion", "3")  # by hand, in the MLflow UI
    with pytest.raises(PromotionError, match="moved outside the registry lock; set it back to one of the two"):
        aliases.promote(MODEL, "2", reason="r", actor="a")
    MlflowClient().set_registered_model_alias(MODEL, "champion", "1")
    assert aliases.promote(MODEL, "2", reason="r", actor="a")["moved"]
    assert chain() == [("promote", "", "1"), ("promote", "1", "2")]


@pytest.mark.parametrize("now, expected", [("2", "done"), ("1", "rolled_back"), ("3", None), (None, None)])
def test_the_outcome_of_a_pending_entry_is_where_its_alias_points(now, expected):
    assert history.outcome({"from_version": "1", "to_version": "2"}, now) == expected
    assert history.outcome({"from_version": "2", "to_version": ""}, None) == "done"  # a removed alias


def test_entries_written_before_write_ahead_records_count_as_done(tracking):
    """Runs without a status tag (written after their move by earlier releases) stay in the history."""
    add_version(MODEL)
    exp = mlflow.set_experiment(history.HISTORY_EXPERIMENT)
    tags = {
        "model": MODEL,
        "alias": "champion",
        "kind": "promote",
        "from_version": "",
        "to_version": "1",
        "reason": "old",
        "actor": "a",
        "at": "2024-01-01T00:00:00.000+00:00",
        "seq": "1",
        "op_id": "",
    }
    MlflowClient().create_run(exp.experiment_id, tags=tags)
    MlflowClient().set_registered_model_alias(MODEL, "champion", "1")
    assert [e["reason"] for e in aliases.history(MODEL)] == ["old"] and history.pending(MODEL) == []
