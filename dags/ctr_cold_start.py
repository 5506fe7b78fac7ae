"""
### CTR cold start (daily, when the day's partition is validated)

A LoRA adapter for **new users and items**, distilled from what serves them today. Scheduled on the
Asset `ctr_lake_validated` (emitted by `ctr_lake_arrival` once the day's partition has arrived and
passed validation; unpausing starts nothing until the next one). For the run's day `D` (the `end_day`
param of a manual run, else the `day` of the triggering event on that event's lake, else the logical
date of `airflow dags test <dag> <date>`) and the `slot` param (`all`, or one slot):

1. **validate** the `cold_start.history_days + window_days` partitions ending at `D` (GX suite; a failure
   stops the run).
2. **detect** the cold users / items: first seen after the serving base's training cutoff
   (`ctr_base@champion`'s `data.last`), or fewer than `cold_start.min_impressions` impressions
   before the window. The cold users who showed up last are held out entirely.
3. **distill** the student (frozen base + a new LoRA adapter, A initialised from the covariance of
   user embeddings) from the teacher (each slot's `ctr_lora_<slot>@champion`, or the base) with
   BCE on the few labelled cold rows + distillation + representation alignment; and the baseline
   (same labelled rows, BCE only, PEFT's default init).
4. **evaluate** teacher, baseline and student on the held-out cold users (AUC, logloss; logged to
   the student's MLflow run) and the serving `ctr_lora_cold_start@champion` on the same rows; then
   the student is judged like any candidate: fairness, calibration, per slot, DeLong, latency, size.
5. **register** the student as `ctr_lora_cold_start` (alias `candidate`, full lineage).
6. **gate_and_promote**: the same gate as every candidate (`configs/gate_policy.yaml`). With
   `approval: true`, the task group **approval** gates, asks a person (**approve_release**) and only
   then **release**s, as in `ctr_lora_retrain` (an unreadable policy is an import error here too).
   The student is gated on the same checks as any candidate: one its evaluation could not measure
   fails unless the policy lists it in `optional_checks`.

Triggered by the same event as `ctr_lora_retrain`: the teacher is whatever `@champion` serves when
distill starts (with `promotion: canary` a retrain releases to `@canary` and leaves it); new users
arrive every day and the gate keeps a worse student from serving. Trigger from the UI with another
`end_day`, a single `slot` (registers `ctr_lora_cold_start_<slot>`) or `lake_uri`.
"""

from __future__ import annotations

from airflow.sdk import Param, TaskGroup

from ctr_airflow.approval import GROUP as APPROVAL_GROUP
from ctr_airflow.approval import gate_approve_release
from ctr_airflow.assets import VALIDATED
from ctr_airflow.dag_defaults import ctr_dag, ctr_task, day_param, lake_uri_param
from ctr_airflow.operators import GatedPromotionOperator, registry_write
from ctr_airflow.runtime import approval_required, pipeline_config, run_day


def _slot(context) -> str:
    return (context.get("params") or {}).get("slot") or "all"


# Data-aware: one run per validated day (ctr_lake_arrival), not a clock; a missed day is re-run by hand
# with end_day.
@ctr_dag(
    "ctr_cold_start",
    __doc__,
    schedule=[VALIDATED],
    tags=["lora", "cold-start", "distillation", "registry"],
    max_active_runs=1,
    params={
        "end_day": day_param(
            "Last day of the cold-start window (default: the validated day that "
            "triggered the run, else the logical date)"
        ),
        "slot": Param(
            "all",
            type="string",
            pattern="^[a-z0-9_]+$",
            description="'all' (one adapter for every slot) or one configured slot",
        ),
        "lake_uri": lake_uri_param(),
    },
)
def ctr_cold_start():
    # Bad data fails the same way on every try: ctr_task fails it without retrying (a DataValidationError).
    @ctr_task
    def validate(**context) -> dict:
        from pipelines.flows.windows import cold_start_days
        from pipelines.validation.stage import validate_window

        cfg = pipeline_config(context)
        # the history before the window too: detection counts impressions there
        return validate_window(cfg, cfg.data.lake_uri, run_day(context), cold_start_days(cfg), log_to_mlflow=True)

    @ctr_task
    def detect(report: dict, **context) -> dict:
        from pipelines.training.cold_start import detect_stage

        cfg = pipeline_config(context)
        return detect_stage(cfg, cfg.data.lake_uri, run_day(context), _slot(context))

    @ctr_task
    def distill(detected: dict, **context) -> dict:
        from pipelines.training.cold_start import distill_stage

        cfg = pipeline_config(context)
        return distill_stage(cfg, cfg.data.lake_uri, detected["end_day"], detected["slot"], detected=detected)

    @ctr_task
    def evaluate(candidate: dict, **context) -> dict:
        from pipelines.evaluation.cold_start import evaluate_stage

        cfg = pipeline_config(context)
        return {"candidate": candidate, "evaluation": evaluate_stage(cfg, cfg.data.lake_uri, candidate)}

    # A retry would register a second version: registration runs once.
    @ctr_task(**registry_write(moves=False))
    def register(evaluated: dict, **context) -> dict:
        from pipelines.flows.cold_start import register_stage

        return register_stage(pipeline_config(context), evaluated["candidate"], evaluated["evaluation"])

    registered = register(evaluate(distill(detect(validate()))))
    if approval_required():  # the same human-in-the-loop step as ctr_lora_retrain (ctr_airflow.approval)
        with TaskGroup(group_id=APPROVAL_GROUP):
            gate_approve_release(registered, what="Cold-start adapter")
    else:
        GatedPromotionOperator(task_id="gate_and_promote", registered=registered)


ctr_cold_start()
