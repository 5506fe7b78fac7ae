"""
### CTR LoRA retrain (daily)

For the run's day `D` (the logical date, or the `end_day` param):

1. **validate** every click-log partition in the trailing window ending at `D` with the GX suite;
   any failure stops the run here: nothing trains, nothing is registered, `@champion` is untouched.
2. **train_adapter** one LoRA adapter per configured slot (mapped), on the frozen serving base
   (`ctr_base@champion`), over the window's older rows.
3. **evaluate** candidate and serving `ctr_lora_<slot>@champion` on the same newest rows.
4. **register** the candidate with lineage tags and alias `candidate`.
5. **gate_and_promote**: non-inferiority against the champion (`configs/gate_policy.yaml`);
   a pass moves `@champion` (recorded in the alias history), a rejection skips the task.
"""
from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import Param, dag, task

from ctr_airflow.operators import GatedPromotionOperator
from ctr_airflow.runtime import pipeline_config, run_day


@dag(
    dag_id="ctr_lora_retrain",
    schedule="0 3 * * *",
    start_date=pendulum.datetime(1997, 1, 1, tz="UTC"),  # early: backtests run on historical days (MovieLens is 1997-98)
    catchup=False,  # a missed day is retrained by hand with end_day; backfilling old windows is rarely wanted
    max_active_runs=1,
    doc_md=__doc__,
    tags=["ctr", "lora", "training", "registry"],
    default_args={"retries": 2, "retry_delay": timedelta(minutes=5), "owner": "ctr-ml"},
    params={
        "end_day": Param(None, type=["null", "string"], format="date",
                         description="Last day of the training window (default: the logical date)"),
        "lake_uri": Param(None, type=["null", "string"], pattern="^(s3://|/).+",
                          description="Override the click-log lake (default: configs/pipeline.yaml)"),
    },
)
def ctr_lora_retrain():
    # Bad data fails the same way on every try: no retries for validation.
    @task(retries=0)
    def validate(**context) -> dict:
        from pipelines.validation.stage import validate_window

        cfg = pipeline_config(context)
        return validate_window(cfg, cfg.data.lake_uri, run_day(context), cfg.lora.window_days, log_to_mlflow=True)

    @task
    def slots(report: dict, **context) -> list[str]:
        return list(pipeline_config(context).data.slots)

    @task
    def train_adapter(slot: str, **context) -> dict:
        from pipelines.training.adapter import train

        cfg = pipeline_config(context)
        return train(cfg, cfg.data.lake_uri, run_day(context), slot)

    @task
    def evaluate(candidate: dict, **context) -> dict:
        from pipelines.evaluation.compare import evaluate as run_eval

        cfg = pipeline_config(context)
        return {"candidate": candidate, "evaluation": run_eval(cfg, cfg.data.lake_uri, candidate)}

    @task
    def register(evaluated: dict, **context) -> dict:
        from pipelines.registry.register import register as run_register

        return run_register(pipeline_config(context), evaluated["candidate"], evaluated["evaluation"])

    trained = train_adapter.expand(slot=slots(validate()))
    registered = register.expand(evaluated=evaluate.expand(candidate=trained))
    GatedPromotionOperator.partial(task_id="gate_and_promote", retries=0).expand(registered=registered)


ctr_lora_retrain()
