"""A slot's retrain end to end: train the adapter, evaluate it against the serving champion,
register it with its lineage, then gate and release it.

The ctr_lora_retrain DAG runs these steps as tasks (train, evaluate, register, gate); the CLI
(`train-adapter --register`) runs `run` in one process. With `lora.judged_on: next_day` the order is
the prequential one: judge the slot's waiting candidates on the day, train and register the day's
candidate, which waits for the next days, then gate and release what the evidence let go.
"""

from __future__ import annotations

from pipelines.config import GatePolicy, PipelineConfig
from pipelines.errors import PromotionError
from pipelines.evaluation.compare import evaluate
from pipelines.promotion import prequential
from pipelines.promotion.release import gate_and_release
from pipelines.registry.register import register
from pipelines.training import adapter


def run(
    cfg: PipelineConfig,
    policy: GatePolicy,
    lake_uri: str,
    end_day: str,
    slot: str,
    *,
    actor: str = "cli",
    progress: bool = False,
) -> dict:
    """train -> evaluate -> register -> gate and release; returns the gate's decision (with
    `lora.judged_on: next_day`: `judge_then_train`'s result).

    In one process nobody can answer an approval: with `approval: true` a passing version stays
    registered and gated, and the release raises PromotionError until a person approves it
    (`python -m pipelines approve`, or the DAG's approval step)."""
    if cfg.lora.judged_on == "next_day":
        return judge_then_train(cfg, policy, lake_uri, end_day, slot, actor=actor, progress=progress)
    candidate = adapter.train(cfg, lake_uri, end_day, slot, progress=progress).to_dict()
    registered = register(cfg, candidate, evaluate(cfg, lake_uri, candidate))
    return gate_and_release(policy, registered["model"], registered["version"], registered["evaluation"], actor=actor)


def judge_then_train(
    cfg: PipelineConfig,
    policy: GatePolicy,
    lake_uri: str,
    day: str,
    slot: str,
    *,
    actor: str = "cli",
    progress: bool = False,
) -> dict:
    """The prequential day of a slot: judge its waiting candidates on `day` (promotion.prequential), train and
    register the candidate of the window ending `day` (it waits), then gate and release what the judge let go
    (`prequential.hand_over`: the ready one, or the day's candidate in its place). Returns {"judged",
    "decision": the gate's decision of the released one or None, "release_refused": why a passing one could not
    go out (an approval is due) or None, "version": the day's candidate}."""
    judged = prequential.judge_slot(cfg, policy, lake_uri, day, slot, actor=actor)
    candidate = adapter.train(cfg, lake_uri, day, slot, progress=progress).to_dict()
    registered = register(cfg, candidate, evaluate(cfg, lake_uri, candidate))
    ready = prequential.hand_over(policy, registered)
    decision, refused = None, None
    if ready["evaluation"] is not None:
        try:
            decision = gate_and_release(policy, ready["model"], ready["version"], ready["evaluation"], actor=actor)
        except PromotionError as exc:  # recorded on the version; a person's approval releases it later
            refused = str(exc)
    return {
        "judged_on": "next_day",
        "model": registered["model"],
        "judged": judged,
        "decision": decision,
        "release_refused": refused,
        "version": registered["version"],
        "existing": registered["existing"],
    }
