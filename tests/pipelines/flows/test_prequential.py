"""The prequential day of a slot (`lora.judged_on: next_day`): judge the waiting candidates on the newly
validated day beside the champion, release the one the evidence lets go, then train the day's candidate on
its whole window and register it waiting. Real stages on a real SQLite MLflow store and a synthetic lake."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pipelines.evaluation import timeline
from pipelines.evaluation.next_day import day_step
from pipelines.flows import retrain
from pipelines.promotion import aliases, prequential
from pipelines.registry import mlflow_io
from tests.pipelines.flows.test_family_lifecycle import lenient_policy


def next_day(cfg):
    return replace(cfg, lora=replace(cfg.lora, judged_on="next_day"))


def _first_champion(cfg, policy) -> str:
    """Day 1 trains v1, which waits; day 2 judges it (no champion: the first-run checks) and releases it."""
    first = retrain.run(cfg, policy, cfg.data.lake_uri, "2024-01-03", "feed", actor="test")
    model = cfg.adapter_model_name("feed")
    mv = mlflow_io.get_version(model, first["version"])
    assert first["judged"]["judged"] == [] and first["decision"] is None  # nothing waited before it
    assert mv.tags["judge.state"] == "waiting" and mv.tags["gate.passed"] == "pending"
    assert mv.tags["judge.trained_through"] == "2024-01-03" and aliases.current(model) is None
    second = retrain.run(cfg, policy, cfg.data.lake_uri, "2024-01-04", "feed", actor="test")
    (judged,) = second["judged"]["judged"]
    assert (judged["version"], judged["verdict"]) == (first["version"], "release")
    assert second["decision"]["passed"] and aliases.current(model) == first["version"]
    return second["version"]


@pytest.mark.slow
def test_a_candidate_trains_on_its_whole_window_waits_and_is_released_on_the_next_day(cfg):
    cfg, policy = next_day(cfg), replace(lenient_policy(), judge_margin=10.0)  # any evidence clears a huge margin
    waiting = _first_champion(cfg, policy)
    model = cfg.adapter_model_name("feed")
    run = mlflow_io.client().get_run(mlflow_io.get_version(model, waiting).run_id)
    assert "holdout_auc" not in run.data.metrics  # nothing held out: the newest day trained it too

    third = retrain.run(cfg, policy, cfg.data.lake_uri, "2024-01-05", "feed", actor="test")
    (judged,) = third["judged"]["judged"]
    assert judged["version"] == waiting and judged["verdict"] == "release" and judged["n"] == judged["n"] > 100
    assert aliases.current(model) == waiting
    mv = mlflow_io.get_version(model, waiting)
    evidence = json.loads(mv.tags["judge.evidence"])
    assert evidence["days"] == 1 and evidence["last_day"] == "2024-01-05" and evidence["n"] == judged["n"]
    checks = {c["name"]: c["passed"] for c in json.loads(mv.tags["gate.checks"])}
    assert checks["sequential_non_inferiority"] and "auc_non_inferiority" not in checks
    history = mlflow_io.client().get_metric_history(mv.run_id, "shadow_candidate_auc")
    assert [m.step for m in history] == [day_step("2024-01-05")]  # the candidate's shadow metrics, per day
    # and the slot's timeline: the judged candidate beside the champion, on the day's step
    line = timeline.run_of(model, "feed")
    figures = mlflow_io.client().get_run(line).data.metrics
    assert figures["candidate_auc"] == judged["candidate_auc"] and figures["champion_auc"] == judged["champion_auc"]


@pytest.mark.slow
def test_a_candidate_the_evidence_cannot_clear_is_rejected_after_its_maximum_wait(cfg):
    cfg = next_day(cfg)
    # Neither worse by 1 nat per row nor better by 1 nat: the test stays undecided; one judged day is the most.
    policy = replace(lenient_policy(), judge_margin=1.0, judge_min_effect=1.0, judge_max_wait_days=1)
    waiting = _first_champion(cfg, policy)
    model = cfg.adapter_model_name("feed")
    champion = aliases.current(model)

    third = retrain.run(cfg, policy, cfg.data.lake_uri, "2024-01-05", "feed", actor="test")
    (judged,) = third["judged"]["judged"]
    assert judged["version"] == waiting and judged["verdict"] == "reject" and third["decision"] is None
    assert "undecided after 1 judged day" in judged["reason"]
    mv = mlflow_io.get_version(model, waiting)
    assert mv.tags["judge.state"] == "reject" and mv.tags["gate.passed"] == "false"
    assert aliases.current(model) == champion  # the champion is untouched
    assert [str(m.version) for m in prequential.waiting_versions(model, "2024-01-06")] == [third["version"]]


@pytest.mark.slow
def test_with_judge_release_successor_the_days_candidate_goes_out_on_its_predecessors_judgement(cfg):
    cfg, policy = next_day(cfg), replace(lenient_policy(), judge_release="successor")
    model = cfg.adapter_model_name("feed")
    first = retrain.run(cfg, policy, cfg.data.lake_uri, "2024-01-03", "feed", actor="test")
    second = retrain.run(cfg, policy, cfg.data.lake_uri, "2024-01-04", "feed", actor="test")
    (judged,) = second["judged"]["judged"]
    assert (judged["version"], judged["verdict"]) == (first["version"], "release")
    # what serves trained through 2024-01-04, as fresh as an ungated release; v1's judgement let it go
    assert second["decision"]["version"] == second["version"] and aliases.current(model) == second["version"]
    new, old = (mlflow_io.get_version(model, v) for v in (second["version"], first["version"]))
    assert new.tags["judge.successor_of"] == first["version"] and new.tags["gate.passed"] == "true"
    assert old.tags["judge.handed_over"] == second["version"] and old.tags["gate.passed"] == "pending"
    # the successor still waits: the next day judges it, serving, beside what it replaced (the test below)
    assert [str(m.version) for m in prequential.waiting_versions(model, "2024-01-05")] == [second["version"]]


@pytest.mark.slow
def test_a_serving_successor_is_judged_beside_the_champion_it_replaced_and_its_own_successor_follows(cfg):
    """Successors keep the daily cadence: each evening's candidate goes out on yesterday's one's judgement."""
    cfg, policy = next_day(cfg), replace(lenient_policy(), judge_release="successor", judge_margin=10.0)
    model = cfg.adapter_model_name("feed")
    retrain.run(cfg, policy, cfg.data.lake_uri, "2024-01-03", "feed", actor="test")
    second = retrain.run(cfg, policy, cfg.data.lake_uri, "2024-01-04", "feed", actor="test")  # v2 serves
    third = retrain.run(cfg, policy, cfg.data.lake_uri, "2024-01-05", "feed", actor="test")
    (judged,) = third["judged"]["judged"]
    assert judged["version"] == second["version"] and judged["serving"] and judged["verdict"] == "release"
    assert aliases.current(model) == third["version"]  # v3 went out on v2's judgement
    v2, v3 = (mlflow_io.get_version(model, v) for v in (second["version"], third["version"]))
    # v2 had nothing before it: judged alone (first-run checks); v3 replaced v2
    assert judged["against"] is None and v3.tags["judge.replaced"] == second["version"]
    assert v3.tags["judge.successor_of"] == second["version"] and v2.tags["judge.handed_over"] == third["version"]


@pytest.mark.slow
def test_a_serving_successor_the_next_day_rejects_lets_no_successor_out(cfg):
    """A rejection stops the chain that evening: nothing ready, so nothing is handed over, and an earlier
    predecessor that already handed over is never used again."""
    cfg = next_day(cfg)
    model = cfg.adapter_model_name("feed")
    lets_go = replace(lenient_policy(), judge_release="successor", judge_margin=10.0)
    retrain.run(cfg, lets_go, cfg.data.lake_uri, "2024-01-03", "feed", actor="test")
    second = retrain.run(cfg, lets_go, cfg.data.lake_uri, "2024-01-04", "feed", actor="test")  # v2 serves
    # v2, the first champion, is judged alone (first-run checks): a floor of 0.99 fails it
    failing = replace(lets_go, min_auc_first_run=0.99)
    third = retrain.run(cfg, failing, cfg.data.lake_uri, "2024-01-05", "feed", actor="test")
    (judged,) = third["judged"]["judged"]
    assert judged["version"] == second["version"] and judged["verdict"] == "reject" and judged["serving"]
    assert third["decision"] is None and aliases.current(model) == second["version"]
    assert [str(m.version) for m in prequential.waiting_versions(model, "2024-01-06")] == [third["version"]]
