"""The backtest's `served` comparator: the pipeline's own stages replayed day by day on MovieLens-100K
(a real lake, a real MLflow store, real GX, real PEFT, the serving code), and its pure summaries."""

import json
import os
import subprocess
import sys

import mlflow
import pytest
from mlflow import MlflowClient

from pipelines.bench import backtest
from pipelines.bench.backtest_verdicts import counts, fault_outcome, gate_precision, trust, wilson
from pipelines.config import load_pipeline_config
from tests.conftest import use_store_copy

SLOT_MODEL = "ctr_lora_morning"  # --quick: the first slot's rows only


def _expected_routes(days: list[dict]) -> list[dict]:
    """The routes each morning should serve, from the decisions the replay recorded the evening before."""
    aliases, expected = {}, []
    for day in days:
        expected.append({f"{SLOT_MODEL}@{a}": f"{SLOT_MODEL}:{v}" for a, v in sorted(aliases.items())})
        for move in day.get("monitor", {}).get("moves", []) + day.get("monitor", {}).get("reverts", []):
            if move.get("kind") == "withdraw":
                aliases.pop("canary", None)
            elif move.get("kind") == "promote":
                aliases["champion"] = move["to_version"]
                aliases.pop("canary", None)
            else:  # a revert
                aliases["champion"] = move["to_version"]
        gate = day.get("gate", {}).get("morning", {})
        if gate.get("released"):
            aliases[gate["alias"]] = gate["version"]
    return expected


@pytest.mark.slow
def test_a_quick_replay_serves_what_its_gates_released_and_leaves_the_callers_registry_alone(
    template_db, tmp_path, monkeypatch
):
    """The shipped config: each evening judges the waiting candidates on the day's rows, trains the day's one on
    its whole window and releases what the judgement let go (the day's candidate, as its predecessor's successor)."""
    callers = use_store_copy(template_db, tmp_path, monkeypatch)
    replay_dir = tmp_path / "replay"
    cfg = load_pipeline_config()
    assert cfg.lora.judged_on == "next_day"
    r = backtest.run(cfg, names=("static", "served"), quick=True, parallel=False, served_dir=str(replay_dir))

    # the replay had a registry of its own; the caller's is untouched and still the one MLflow uses
    assert os.environ["MLFLOW_TRACKING_URI"] == callers and mlflow.get_tracking_uri() == callers
    assert MlflowClient().search_registered_models() == []

    served = r["comparators"]["served"]
    days = served["days"]
    assert r["days"] == len(days) == 7 and 0.55 < r["served_auc"] < 0.9
    assert served["base"]["passed"] and served["base"]["moved"]
    # the first two mornings only the base serves (the first candidate waits for its judged day); every
    # morning serves what the evening before released
    assert days[0]["scored_by"] == {f"ctr_base:{served['base']['version']}": r["per_day"][0]["rows"]}
    assert days[1]["routes"] == {} and [d["routes"] for d in days] == _expected_routes(days)
    assert any(d["routes"] for d in days[2:])
    for d in days:
        assert sum(d["scored_by"].values()) == r["per_day"][days.index(d)]["rows"]
        assert set(d["scored_by"]) <= set(d["routes"].values()) | {f"ctr_base:{served['base']['version']}"}

    # every evening trains one candidate; the first evening judges nothing, each later one judges yesterday's
    gates = [d["gate"]["morning"] for d in days]
    assert [g["trained"] for g in gates] == [str(v) for v in range(1, 8)] and gates[0]["judged"] == []
    assert all(
        [j["version"] for j in g["judged"]] and str(int(g["trained"]) - 1) in [j["version"] for j in g["judged"]]
        for g in gates[1:]
    )
    released = [g for g in gates if g.get("released")]
    assert released and released[0]["alias"] == "champion"  # the first release becomes the champion
    for g in released:  # released in the judged one's place: the candidate trained that same evening
        assert g["version"] == g["trained"]
    assert r["reverts"] == 0 and r["days_not_validated"] == []
    precision = r["gate_precision"]
    assert precision["n"] <= len(released) and (
        precision["n"] == 0 or precision["lo"] <= precision["value"] <= precision["hi"]
    )

    # the trivial policies on the same rows: the first morning all three serve the base; the second morning
    # always_release serves the first evening's candidate, never_release and served still the base
    first, second = r["per_day"][0], r["per_day"][1]
    assert first["always_release"] == first["never_release"] == first["served"]
    assert second["never_release"] == second["served"]
    assert 0.55 < r["always_release_auc"] < 0.9 and 0.55 < r["never_release_auc"] < 0.9
    assert "always_release_cpu_s" not in r and r["served_minus_never_release"] == round(
        r["served_auc"] - r["never_release_auc"], 4
    )

    # the replay's own store holds what was decided
    replay = MlflowClient(
        tracking_uri=f"sqlite:///{replay_dir / 'mlflow.db'}", registry_uri=f"sqlite:///{replay_dir / 'mlflow.db'}"
    )
    assert len(replay.search_model_versions(f"name = '{SLOT_MODEL}'")) == 7
    final = _expected_routes(days + [{}])[-1]
    assert (
        f"{SLOT_MODEL}:{replay.get_model_version_by_alias(SLOT_MODEL, 'champion').version}"
        == final[f"{SLOT_MODEL}@champion"]
    )


@pytest.mark.slow
def test_a_day_of_flipped_labels_never_reaches_serving(tmp_path):
    day = "1998-03-03"  # 388 of the slot's rows
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipelines",
            "backtest",
            "--quick",
            "--days",
            "5",
            "--only",
            "served",
            "--flip-labels",
            day,
            "--served-dir",
            str(tmp_path / "replay"),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    )
    r = json.loads(out.stdout)
    days = r["comparators"]["served"]["days"]
    assert [d["date"] for d in days] == ["1998-02-28", "1998-03-01", "1998-03-02", "1998-03-03", "1998-03-04"]
    # validation lets it through (MovieLens runs with drift as a warning); on its rows what is judged that
    # evening falls below the AUC floor: nothing is released in its place, the day's candidate never serves
    fault = r["fault"]
    assert fault["day"] == day and fault["caught_by"] == "gate", fault
    assert {"auc_floor_every_run", "auc_floor"} & set(fault["failed_checks"]), fault  # (the latter with no champion)
    trained_on_it = days[3]["gate"]["morning"]["trained"]
    assert not days[3]["gate"]["morning"].get("released")
    assert f"ctr_lora_morning:{trained_on_it}" not in days[4]["routes"].values()


# ------------------------------------------------------------------------------------- pure parts
def _day(date, gate=None, moves=(), reverts=(), validated=True):
    return {
        "date": date,
        "validated": validated,
        "gate": gate or {},
        "monitor": {"moves": list(moves), "reverts": list(reverts), "errors": []},
    }


def test_counts_add_up_decisions_moves_and_reverts():
    days = [
        _day(
            "d1",
            {
                "a": {"version": "1", "passed": True, "released": True, "alias": "champion"},
                "b": {"error": "too few rows"},
            },
        ),
        _day(
            "d2",
            {"a": {"version": "2", "passed": False, "released": False, "alias": None}},
            moves=[{"model": "m_a", "kind": "promote", "to_version": "1"}],
        ),
        _day(
            "d3",
            moves=[{"model": "m_a", "kind": "withdraw", "to_version": None}],
            reverts=[{"model": "m_a", "to_version": "1", "reason": "r"}],
            validated=False,
        ),
    ]
    assert counts(days) == {
        "gate_releases": 1,
        "gate_rejections": 1,
        "judge_waits": 0,
        "gate_held": 0,
        "canary_promotions": 1,
        "canary_withdrawals": 1,
        "reverts": 1,
        "days_not_validated": ["d3"],
    }


def test_trust_counts_released_worse_and_rejected_better_beyond_the_tolerance():
    def j(released, cand, against):
        return {"released": released, "passed": released, "candidate_auc": cand, "against_auc": against}

    judged = [
        j(True, 0.70, 0.71),
        j(True, 0.709, 0.71),
        j(True, 0.72, 0.71),  # one worse by > 0.005
        j(False, 0.72, 0.71),
        j(False, 0.712, 0.71),
        j(False, None, 0.7),
    ]  # one better; one unjudged
    t = trust(judged, 0.005)
    assert (t["released_judged"], t["released_worse"], t["released_worse_share"]) == (3, 1, 0.333)
    assert (t["rejected_judged"], t["rejected_better"], t["rejected_better_share"]) == (2, 1, 0.5)
    assert trust([], 0.005)["released_worse_share"] is None


def test_gate_precision_is_the_share_of_judged_releases_that_beat_their_champion_with_a_wilson_interval():
    def j(released, cand, against):
        return {"released": released, "passed": released, "candidate_auc": cand, "against_auc": against}

    judged = [
        j(True, 0.72, 0.71),
        j(True, 0.70, 0.71),
        j(True, 0.73, 0.71),
        j(True, 0.74, 0.71),
        j(True, 0.75, None),
        j(False, 0.80, 0.71),
    ]  # a first champion and a rejection do not count
    assert gate_precision(judged) == wilson(3, 4)
    w = wilson(3, 4)
    assert w["value"] == 0.75 and w["n"] == 4 and (w["lo"], w["hi"]) == (0.3006, 0.9544)  # Wilson's 95% bounds
    assert wilson(0, 0) == {"value": None, "lo": None, "hi": None, "n": 0}
    assert wilson(10, 10)["hi"] == 1.0 and wilson(0, 10)["lo"] == 0.0


def test_the_fault_outcome_names_what_stopped_the_faulty_day():
    released = {"a": {"version": "3", "passed": True, "released": True}}
    rejected = {"a": {"version": "3", "passed": False, "released": False, "failed_checks": ["auc_floor_every_run"]}}
    held = {"a": {"version": "3", "passed": True, "released": False, "held": True}}
    revert = {"model": "ctr_lora_a", "to_version": "2", "reason": "auto-revert"}
    assert fault_outcome([_day("d1")], "d9", 3)["caught_by"] is None
    stopped = fault_outcome([{**_day("d1", validated=False), "failed_checks": ["label_leak"]}], "d1", 3)
    assert stopped["caught_by"] == "validation" and stopped["failed_checks"] == ["label_leak"]
    gate = fault_outcome([_day("d1", rejected)], "d1", 3)
    assert gate["caught_by"] == "gate" and gate["failed_checks"] == ["auc_floor_every_run"]
    # not released, but not stopped by judgement: it passed and waits behind a canary, or nothing was gated
    assert fault_outcome([_day("d1", held)], "d1", 3)["caught_by"] is None
    assert fault_outcome([_day("d1", {"a": {"error": "too few rows"}})], "d1", 3)["caught_by"] is None
    caught = [_day("d1", released), _day("d2"), _day("d3", reverts=[revert])]
    assert fault_outcome(caught, "d1", 3)["caught_by"] == "monitor"
    assert fault_outcome(caught, "d1", 1)["caught_by"] == "not_stopped"  # the revert came after the window
    withdraw_a = {"model": "ctr_lora_a", "kind": "withdraw", "to_version": None}
    withdrawn = [_day("d1", released), _day("d2", moves=[withdraw_a])]
    assert fault_outcome(withdrawn, "d1", 3)["caught_by"] == "monitor"
    kept = [_day("d1", released), _day("d2", moves=[{"model": "ctr_lora_b", "kind": "withdraw", "to_version": None}])]
    assert fault_outcome(kept, "d1", 3)["caught_by"] == "not_stopped"  # another slot's canary went


def test_the_table_says_what_the_pipeline_decided():
    r = {
        "from": "d1",
        "to": "d2",
        "days": 2,
        "rows": 10,
        "warm_rows": 4,
        "cold_rows": 6,
        "served_auc": 0.7,
        "served_auc_warm": 0.8,
        "served_auc_cold": 0.6,
        "served_auc_new_item": 0.65,
        "served_auc_within_slot_day": 0.66,
        "served_cpu_s": 1.0,
        "gate_releases": 2,
        "gate_rejections": 1,
        "gate_held": 1,
        "canary_promotions": 1,
        "canary_withdrawals": 0,
        "reverts": 0,
        "gate_trust": trust([], 0.0015),
        "gate_precision": wilson(2, 3),
        "fault": {"day": "d1", "caught_by": "gate"},
        "never_release_auc": 0.69,
        "never_release_auc_warm": 0.79,
        "never_release_auc_cold": 0.59,
    }
    text = backtest.table(r)
    assert "| never_release | 0.69 | 0.79 | 0.59 | None | None | - |" in text
    assert "gate precision 0.6667 [0.2077, 0.9385] of 3" in text
    assert "| served | 0.7 | 0.8 | 0.6 | 0.65 | 0.66 | 1.0 |" in text
    assert "2 releases, 1 rejections, 1 held, 0 waits (judged on the next days); canaries 1 promoted" in text
    assert "caught by gate" in text


def test_a_candidate_judged_on_later_days_is_followed_to_its_verdict():
    """lora.judged_on next_day: the candidate trained on the faulty day is decided on a later evening."""

    def trained(new, judged=(), **decision):
        return {"a": {"trained": new, "judged": list(judged), "rejections": 0, **decision}}

    waits = {"version": "1", "verdict": "wait"}
    rejects = {"version": "1", "verdict": "reject", "failed": ["auc_floor_every_run"]}
    days = [_day("d1", trained("1")), _day("d2", trained("2", [waits])), _day("d3", trained("3", [rejects]))]
    assert fault_outcome(days, "d1", 3) == {
        "day": "d1",
        "caught_by": "gate",
        "failed_checks": ["auc_floor_every_run"],
        "why": "every candidate trained on it was rejected; failed ['auc_floor_every_run']",
    }
    assert fault_outcome(days[:2], "d1", 3)["caught_by"] is None  # still waiting when the replay ended
    released = {"version": "1", "verdict": "release"}
    went = [
        _day("d1", trained("1")),
        _day("d2", trained("2", [released], version="1", passed=True, released=True)),
        _day("d3", reverts=[{"model": "m_a", "to_version": "0", "reason": "r"}]),
    ]
    assert fault_outcome(went, "d1", 3)["caught_by"] == "monitor"
    assert fault_outcome(went[:2], "d1", 3)["caught_by"] == "not_stopped"
    assert counts(days)["judge_waits"] == 1
    # judge_release successor: the faulty evening rejected yesterday's candidate on the faulty rows, so the
    # day's candidate did not go out in its place; it never served (a later successor, trained on more, did)
    blocked = [
        _day("d1", trained("1", [{"version": "0", "verdict": "reject", "failed": ["auc_floor_every_run"]}])),
        _day("d2", trained("2", [{"version": "1", "verdict": "superseded"}])),
    ]
    assert fault_outcome(blocked, "d1", 3)["caught_by"] == "gate"
    went_same_evening = [
        _day("d1", trained("1", [{"version": "0", "verdict": "release"}], version="1", passed=True, released=True))
    ]
    assert fault_outcome(went_same_evening, "d1", 3)["caught_by"] == "not_stopped"
