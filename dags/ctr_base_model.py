"""
### CTR base model

A new base is a release, gated like an adapter:

1. **validate** every partition from `base_training.train_start` up to the run's day (GX suite).
2. **train** the frozen base CTR model from scratch on them, and score it and the serving base
   (`ctr_base@champion`) on the same holdout rows.
3. **register** it as `ctr_base@candidate`, tagged with the sha256 fingerprint of its weights
   (idempotent: the same weights return the existing version).
4. **gate_and_promote**: AUC and logloss non-inferiority against the serving base (the first base:
   the policy's floor and ceiling) and calibration; a pass moves `ctr_base@champion` in one recorded
   move whose reason lists the serving adapters it makes incompatible, a rejection fails the run and
   leaves the serving base alone. With `approval: true` in the gate policy a person approves first
   (task group **approval**, as in ctr_lora_retrain).

Adapters record the base version and fingerprint they were trained on: after a new base, every
adapter champion on the old one is refused by later moves until it is retrained, and the next
`ctr_lora_retrain` run trains on the new base. Manual: a new base is a deliberate decision.
"""

from __future__ import annotations


from airflow.sdk import TaskGroup

from ctr_airflow.approval import GROUP as APPROVAL_GROUP
from ctr_airflow.approval import gate_approve_release
from ctr_airflow.dag_defaults import ctr_dag, ctr_task, day_param, lake_uri_param
from ctr_airflow.operators import GatedPromotionOperator, registry_write
from ctr_airflow.runtime import approval_required, pipeline_config, run_day


@ctr_dag(
    "ctr_base_model",
    __doc__,
    schedule=None,
    tags=["base-model", "training", "registry"],
    params={
        "end_day": day_param("Training cutoff: last day of data the base sees (default: logical date)"),
        "lake_uri": lake_uri_param(),
    },
)
def ctr_base_model():
    @ctr_task
    def validate(**context) -> dict:
        from pipelines.flows.windows import base_days
        from pipelines.validation.stage import validate_window

        cfg = pipeline_config(context)
        day = run_day(context)
        return validate_window(cfg, cfg.data.lake_uri, day, base_days(cfg, day), log_to_mlflow=True)

    @ctr_task
    def train(report: dict, **context) -> dict:
        from pipelines.training.base_model import train as run_train

        cfg = pipeline_config(context)
        return run_train(cfg, cfg.data.lake_uri, run_day(context))

    @ctr_task(**registry_write(moves=False))
    def register(trained: dict, **context) -> dict:
        from pipelines.flows.base import register_candidate

        return register_candidate(pipeline_config(context), trained)

    registered = register(train(validate()))
    if approval_required():
        with TaskGroup(group_id=APPROVAL_GROUP):
            gate_approve_release(registered, what="CTR base model")
    else:
        # A rejected base fails the run: a person asked for this base and must see that it did not go out.
        GatedPromotionOperator(task_id="gate_and_promote", registered=registered, fail_on_reject=True)


ctr_base_model()
