"""Stage: judge a slot's waiting candidates on a newly validated day (the prequential gate, issue 31 item 3).

With `lora.judged_on: next_day` a candidate trains on its whole window, the newest day included, and is
registered `waiting` (tag `judge.state`). Every validated day after its window, before that day's candidate
trains, `judge_slot` scores each waiting candidate of the slot and the serving champion on the day's rows
(`evaluation.next_day`) and adds the day's paired per-row logloss differences to the candidate's evidence
(tag `judge.evidence`: n, sum, sum of squares, the champion they were measured against, the judged days).
`promotion.sequential.decide` reads the evidence through a confidence sequence that stays valid at every
daily look, and the gate (`gate.decide`) puts that verdict next to the safety checks, which act at once:

* a safety check fails on a day of at least `judge_min_rows` rows (AUC floor, calibration where the champion
  stays in the band on the same rows, fairness, latency, interference), or the sequential test
  says worse beyond the margin, or `judge_max_wait_days` judged days leave it undecided: the rejection is
  recorded on the version (`gate.run`), which stays out of serving;
* the test says release and every check passes: the candidate is returned as `to_gate` (the newest one when
  several are ready; the older ready ones are `superseded`), for the gate-and-release step that releases
  it as the policy says (canary, approval, direct), exactly as a holdout-judged candidate;
* otherwise it keeps waiting, its evidence saved.

A champion that changes while a candidate waits restarts its evidence: differences against another model do
not add up. With no champion yet, the first candidate's first judged day decides it on the first-run checks.
"""
from __future__ import annotations

import json
import logging

from pipelines.config import GatePolicy, PipelineConfig
from pipelines.promotion import gate, sequential

log = logging.getLogger(__name__)

STATE_TAG, EVIDENCE_TAG = "judge.state", "judge.evidence"
# waiting -> release (handed to the gate-and-release step) | reject | superseded (a newer ready one went)
WAITING = "waiting"


def waiting_versions(model: str, day: str) -> list:
    """The versions of `model` waiting to be judged whose window ended before `day`, oldest first."""
    from pipelines.registry import mlflow_io

    found = mlflow_io.client().search_model_versions(f"name = '{model}' and tags.`{STATE_TAG}` = '{WAITING}'")
    return sorted((mv for mv in found if mv.tags.get("judge.trained_through", "9999") < day), key=lambda mv: int(mv.version))


def judge_slot(cfg: PipelineConfig, policy: GatePolicy, lake_uri: str, day: str, slot: str, *,
               actor: str = "cli") -> dict:
    """Judge `slot`'s waiting candidates on validated `day`. Returns {"model", "slot", "day", "judged": one
    summary per candidate, "to_gate": {"model", "version", "slot", "evaluation"} of the one to release, or None}."""
    from pipelines.registry import mlflow_io

    model = cfg.adapter_model_name(slot)
    judged = [_judge_one(cfg, policy, lake_uri, day, model, mv, actor) for mv in waiting_versions(model, day)]
    ready = [j for j in judged if j["verdict"] == "release"]
    for older in ready[:-1]:   # the freshest ready candidate goes; the older ones would replace it tomorrow
        mlflow_io.client().set_model_version_tag(model, older["version"], STATE_TAG, "superseded")
        older["verdict"] = "superseded"
    to_gate = None
    if ready:
        newest = ready[-1]
        to_gate = {"model": model, "version": newest["version"], "slot": slot, "evaluation": newest.pop("evaluation")}
    for j in judged:
        j.pop("evaluation", None)
    return {"model": model, "slot": slot, "day": day, "judged": judged, "to_gate": to_gate}


def for_gate(judged: dict) -> dict:
    """What the gate-and-release step takes from `judge_slot`'s result: the ready candidate (model, version, slot,
    evaluation), or, where none is ready, the slot's model with no evaluation and a reason (the step skips)."""
    if judged["to_gate"]:
        return judged["to_gate"]
    said = "; ".join(f"v{j['version']} {j['verdict']}: {j.get('reason')}" for j in judged["judged"])
    return {"model": judged["model"], "version": None, "slot": judged["slot"], "evaluation": None,
            "reason": f"{judged['model']}: nothing ready to release on {judged['day']}" + (f" ({said})" if said else
                                                                                          " (no candidate waited)")}


def _judge_one(cfg: PipelineConfig, policy: GatePolicy, lake_uri: str, day: str, model: str, mv, actor: str) -> dict:
    from pipelines.evaluation.next_day import evaluate_day
    from pipelines.registry import mlflow_io

    version = str(mv.version)
    out = {"version": version, "day": day}
    evaluation = evaluate_day(cfg, lake_uri, model, version, day)
    if evaluation is None:
        return {**out, "verdict": "wait", "reason": f"no row of its slot on {day}"}
    state = json.loads(mv.tags.get(EVIDENCE_TAG) or "{}")
    against = evaluation["champion_version"]
    if state.get("against") != against:   # a new champion: differences against another model do not add up
        state = {}
    evidence = sequential.Evidence.from_json(state) if state else sequential.Evidence()
    if evaluation["evidence"] is not None:
        evidence = evidence.merge(sequential.Evidence.from_json(evaluation["evidence"]))
    days = int(state.get("days", 0)) + 1
    seq = {**verdict(policy, evidence if against else None, days), "days": days}
    evaluation["sequential"] = seq
    c = mlflow_io.client()
    c.set_model_version_tag(model, version, EVIDENCE_TAG, json.dumps(
        {**evidence.to_json(), "against": against, "days": days, "last_day": day}))
    decision = gate.decide(policy, evaluation, base=gate.fingerprints(mv))
    unsafe = [ch["name"] for ch in decision["checks"] if not ch["passed"] and ch["name"] != "sequential_non_inferiority"]
    out.update(evaluation=evaluation, n=seq.get("n"), lower=seq.get("lower"), upper=seq.get("upper"),
               candidate_auc=evaluation["candidate"].get("auc"), champion_auc=(evaluation["champion"] or {}).get("auc"),
               against=against)
    if unsafe and seq["verdict"] != "reject" and evaluation["holdout_rows"] < policy.judge_min_rows:
        # an AUC floor or a calibration band on a few dozen rows is noise: such a day adds evidence, not a verdict
        why = f"{unsafe} failed on {evaluation['holdout_rows']} rows, fewer than judge_min_rows: not acted on"
        log.info("%s v%s waits after %s: %s", model, version, day, why)
        return {**out, "verdict": "wait", "reason": why}
    if seq["verdict"] == "wait" and not unsafe:
        log.info("%s v%s waits after %s: %s", model, version, day, seq["reason"])
        return {**out, "verdict": "wait", "reason": seq["reason"]}
    if decision["passed"]:
        c.set_model_version_tag(model, version, STATE_TAG, "release")
        return {**out, "verdict": "release", "reason": seq["reason"]}
    gate.run(policy, model, version, evaluation, actor=actor)   # records the rejection on the version
    c.set_model_version_tag(model, version, STATE_TAG, "reject")
    return {**out, "verdict": "reject", "reason": f"failed {unsafe}" if unsafe else seq["reason"], "failed": unsafe}


def verdict(policy: GatePolicy, evidence: sequential.Evidence | None, days: int) -> dict:
    """The sequential test's verdict on the evidence (pure); with no champion (`evidence` None) a release, which
    the first-run checks then decide; undecided after `judge_max_wait_days` judged days: a rejection."""
    if evidence is None:
        return {"verdict": "release", "n": None, "reason": "no champion yet: the first-run checks decide"}
    seq = sequential.decide(evidence, alpha=policy.judge_alpha, margin=policy.judge_margin,
                            planned_rows=policy.judge_planned_rows, min_rows=policy.judge_min_rows,
                            min_effect=policy.judge_min_effect)
    if seq["verdict"] == "wait" and days >= policy.judge_max_wait_days:
        return {**seq, "verdict": "reject", "reason": f"undecided after {days} judged day(s): {seq['reason']}"}
    return seq
