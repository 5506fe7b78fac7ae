"""Stage: judge a slot's waiting candidates on a newly validated day (the prequential gate, issue 31 item 3).

With `lora.judged_on: next_day` a candidate trains on its whole window, the newest day included, and is
registered `waiting` (tag `judge.state`). Every validated day after its window, before that day's candidate
trains, `judge_slot` scores each waiting candidate of the slot and the serving champion on the day's rows it
trains on (`evaluation.next_day`) and adds the day's paired per-row logloss differences to the candidate's evidence
(tag `judge.evidence`: n, sum, sum of squares, the champion they were measured against, the judged days).
`promotion.sequential.decide` reads the evidence through a confidence sequence that stays valid at every
daily look, and the gate (`gate.decide`) puts that verdict next to the safety checks, which act at once:

* a safety check fails on a day of at least `judge_min_rows` rows (AUC floor, calibration where the champion
  stays in the band on the same rows, fairness, latency, interference), or the sequential test
  says worse beyond the margin, or `judge_max_wait_days` judged days leave it undecided: the rejection is
  recorded on the version (`gate_record.run`), which stays out of serving;
* the test says release and every check passes: the candidate is tagged `release` and its evaluation kept on
  its run (the newest one when several are ready; the older ready ones are `superseded`);
* otherwise it keeps waiting, its evidence saved.

Once the day's candidate is registered, `hand_over` gives the gate-and-release step what to release, as the
policy says (canary, approval, direct), exactly as a holdout-judged candidate: the ready one, or with
`judge_release: successor` the day's candidate in its place, gated on its predecessor's judgement (it trained
on one more day of the same slot's validated rows, with the same config and base): what serves is then as
fresh as an ungated release, and still judged on rows it never trained on.

A champion that changes while a candidate waits restarts its evidence: differences against another model do
not add up. With no champion yet, the first candidate's first judged day decides it on the first-run checks.
"""

from __future__ import annotations

import json
import logging
import tempfile

from pipelines.config import GatePolicy, PipelineConfig
from pipelines.evaluation.next_day import evaluate_day
from pipelines.promotion import gate, gate_record, sequential
from pipelines.registry import mlflow_io

log = logging.getLogger(__name__)

STATE_TAG, EVIDENCE_TAG = "judge.state", "judge.evidence"
REPLACED_TAG = "judge.replaced"  # on a successor: the champion it was released to replace
READY_FILE = "evaluation.json"  # the evaluation a ready candidate is gated on, under judge/<day>/ of its run
# waiting -> release (ready for the gate-and-release step) | reject | superseded (a newer ready one went)
WAITING = "waiting"


def waiting_versions(model: str, day: str) -> list:
    """The versions of `model` waiting to be judged whose window ended before `day`, oldest first."""

    found = mlflow_io.client().search_model_versions(f"name = '{model}' and tags.`{STATE_TAG}` = '{WAITING}'")
    due = (mv for mv in found if mv.tags.get("judge.trained_through", "9999") < day)
    return sorted(due, key=lambda mv: int(mv.version))


def judge_slot(
    cfg: PipelineConfig, policy: GatePolicy, lake_uri: str, day: str, slot: str, *, actor: str = "cli"
) -> dict:
    """Judge `slot`'s waiting candidates on validated `day`. Returns {"model", "slot", "day", "judged": one
    summary per candidate, "ready": the version the evidence lets go (tagged `release`), or None}; `hand_over`
    then says what the gate-and-release step releases."""

    model = cfg.adapter_model_name(slot)
    judged = [_judge_one(cfg, policy, lake_uri, day, model, mv, actor) for mv in waiting_versions(model, day)]
    ready = [j for j in judged if j["verdict"] == "release"]
    for older in ready[:-1]:  # the freshest ready candidate goes; the older ones would replace it tomorrow
        mlflow_io.client().set_model_version_tag(model, older["version"], STATE_TAG, "superseded")
        older["verdict"] = "superseded"
    for j in judged:
        j.pop("evaluation", None)
    return {
        "model": model,
        "slot": slot,
        "day": day,
        "judged": judged,
        "ready": ready[-1]["version"] if ready else None,
    }


def hand_over(policy: GatePolicy, registered: dict) -> dict:
    """What the gate-and-release step gates after the day's candidate `registered` (register's result) was
    registered: the slot's candidate the judge found ready (the newest one tagged `release` and not yet gated), or,
    with `judge_release: successor`, `registered` itself in its place, gated on its predecessor's judgement
    (tags `judge.successor_of` and `judge.replaced` on it, `judge.handed_over` on the predecessor). Returns
    {"model", "version", "slot", "evaluation"}; with nothing ready, evaluation None and the reason (the step
    then skips)."""

    model, slot = registered["model"], registered["slot"]
    c = mlflow_io.client()
    # Ready: judged `release` and not yet used: gated itself (judged), or handed to a successor (successor).
    ready = [
        mv
        for mv in c.search_model_versions(f"name = '{model}' and tags.`{STATE_TAG}` = 'release'")
        if not mv.tags.get("judge.handed_over")
        and (policy.judge_release == "successor" or mv.tags.get("gate.passed") == "pending")
    ]
    if not ready:
        return {
            "model": model,
            "version": None,
            "slot": slot,
            "evaluation": None,
            "reason": f"{model}: no candidate is ready to release (its judged days have not let one go)",
        }
    judged = max(ready, key=lambda mv: int(mv.version))
    day = json.loads(judged.tags[EVIDENCE_TAG])["last_day"]
    evaluation = _load_ready(judged.run_id, day)
    version = str(judged.version)
    if policy.judge_release == "successor" and str(registered["version"]) != version:
        # Gated against the champion it would replace (the stale-gate rule of the release holds), on the judged
        # one's evidence; it stays waiting: once it serves, the next day judges it beside the one it replaced.
        version = str(registered["version"])
        serving = mlflow_io.version_by_alias(model, "champion")
        evaluation = {
            **evaluation,
            "successor_of": str(judged.version),
            "champion_version": str(serving.version) if serving else None,
        }
        c.set_model_version_tag(model, version, "judge.successor_of", str(judged.version))
        if serving is not None:
            c.set_model_version_tag(model, version, REPLACED_TAG, str(serving.version))
        c.set_model_version_tag(model, str(judged.version), "judge.handed_over", version)
    return {"model": model, "version": version, "slot": slot, "evaluation": evaluation}


def _judge_one(cfg: PipelineConfig, policy: GatePolicy, lake_uri: str, day: str, model: str, mv, actor: str) -> dict:

    version = str(mv.version)
    out = {"version": version, "day": day}
    # A successor released on its predecessor's judgement serves already: it is judged beside the one it replaced.
    serving = _serves(model, version)
    replaced = mv.tags.get(REPLACED_TAG) if serving else None
    evaluation = evaluate_day(cfg, lake_uri, model, version, day, against=replaced, alone=serving and not replaced)
    if evaluation is None:
        return {**out, "verdict": "wait", "reason": f"no row of its slot on {day}"}
    state = json.loads(mv.tags.get(EVIDENCE_TAG) or "{}")
    against = evaluation["champion_version"]
    if state.get("against") != against:  # a new champion: differences against another model do not add up
        state = {}
    evidence = sequential.Evidence.from_json(state) if state else sequential.Evidence()
    if evaluation["evidence"] is not None:
        evidence = evidence.merge(sequential.Evidence.from_json(evaluation["evidence"]))
    days = int(state.get("days", 0)) + 1
    seq = {**verdict(policy, evidence if against else None, days), "days": days}
    evaluation["sequential"] = seq
    c = mlflow_io.client()
    c.set_model_version_tag(
        model,
        version,
        EVIDENCE_TAG,
        json.dumps({**evidence.to_json(), "against": against, "days": days, "last_day": day}),
    )
    decision = gate.decide(policy, evaluation, base=gate_record.fingerprints(mv))
    unsafe = [
        ch["name"] for ch in decision["checks"] if not ch["passed"] and ch["name"] != "sequential_non_inferiority"
    ]
    out.update(
        evaluation=evaluation,
        n=seq.get("n"),
        lower=seq.get("lower"),
        upper=seq.get("upper"),
        candidate_auc=evaluation["candidate"].get("auc"),
        champion_auc=(evaluation["champion"] or {}).get("auc"),
        against=against,
    )
    if unsafe and seq["verdict"] != "reject" and evaluation["holdout_rows"] < policy.judge_min_rows:
        # an AUC floor or a calibration band on a few dozen rows is noise: such a day adds evidence, not a verdict
        why = f"{unsafe} failed on {evaluation['holdout_rows']} rows, fewer than judge_min_rows: not acted on"
        log.info("%s v%s waits after %s: %s", model, version, day, why)
        return {**out, "verdict": "wait", "reason": why}
    if seq["verdict"] == "wait" and not unsafe:
        log.info("%s v%s waits after %s: %s", model, version, day, seq["reason"])
        return {**out, "verdict": "wait", "reason": seq["reason"]}
    if serving:  # a verdict says whether its successor may follow it; nothing is gated on it
        state = "release" if decision["passed"] else "reject"
        if decision["passed"]:
            c.log_dict(mv.run_id, _json_safe(evaluation), f"judge/{day}/{READY_FILE}")
        c.set_model_version_tag(model, version, STATE_TAG, state)
        return {
            **out,
            "verdict": state,
            "reason": seq["reason"] if not unsafe else f"failed {unsafe}",
            "failed": unsafe,
            "serving": True,
        }
    if decision["passed"]:  # kept on its run: the gate-and-release step reads it there (`hand_over`)
        c.log_dict(mv.run_id, _json_safe(evaluation), f"judge/{day}/{READY_FILE}")
        c.set_model_version_tag(model, version, STATE_TAG, "release")
        return {**out, "verdict": "release", "reason": seq["reason"]}
    gate_record.run(policy, model, version, evaluation, actor=actor)  # records the rejection on the version
    c.set_model_version_tag(model, version, STATE_TAG, "reject")
    return {**out, "verdict": "reject", "reason": f"failed {unsafe}" if unsafe else seq["reason"], "failed": unsafe}


def verdict(policy: GatePolicy, evidence: sequential.Evidence | None, days: int) -> dict:
    """The sequential test's verdict on the evidence (pure); with no champion (`evidence` None) a release, which
    the first-run checks then decide; undecided after `judge_max_wait_days` judged days: a rejection."""
    if evidence is None:
        return {"verdict": "release", "n": None, "reason": "no champion yet: the first-run checks decide"}
    seq = sequential.decide(
        evidence,
        alpha=policy.judge_alpha,
        margin=policy.judge_margin,
        planned_rows=policy.judge_planned_rows,
        min_rows=policy.judge_min_rows,
        min_effect=policy.judge_min_effect,
        burden=policy.judge_burden,
    )
    if seq["verdict"] == "wait" and days >= policy.judge_max_wait_days:
        return {**seq, "verdict": "reject", "reason": f"undecided after {days} judged day(s): {seq['reason']}"}
    return seq


def _load_ready(run_id: str, day: str) -> dict:

    with tempfile.TemporaryDirectory() as tmp:
        path = mlflow_io.client().download_artifacts(run_id, f"judge/{day}/{READY_FILE}", tmp)
        with open(path) as fh:
            return json.load(fh)


def _json_safe(obj):
    return json.loads(json.dumps(obj, default=lambda v: v.item() if hasattr(v, "item") else str(v)))


def _serves(model: str, version: str) -> bool:

    champion = mlflow_io.version_by_alias(model, "champion")
    return champion is not None and str(champion.version) == version
