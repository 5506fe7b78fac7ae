"""
### CTR base model

Trains the frozen base CTR model from scratch on every validated partition from
`base_training.train_start` up to the run's day, registers it as `ctr_base` (tagged with the sha256
fingerprint of its weights) and makes it the serving base (`ctr_base@champion`). Adapters record
the base version and fingerprint they were trained on; a new base means adapters must be retrained.
Manual: a new base is a deliberate decision, not a schedule.
"""
from __future__ import annotations

from airflow.sdk import task

from ctr_airflow.dag_defaults import ctr_dag, day_param, lake_uri_param
from ctr_airflow.operators import registry_write
from ctr_airflow.runtime import actor, pipeline_config, run_day


@ctr_dag("ctr_base_model", __doc__, schedule=None, tags=["base-model", "training", "registry"], retries=1,
         params={"end_day": day_param("Training cutoff: last day of data the base sees (default: logical date)"),
                 "lake_uri": lake_uri_param()})
def ctr_base_model():
    @task(retries=0)
    def validate(**context) -> dict:
        from pipelines.flows.windows import base_days
        from pipelines.validation.stage import validate_window

        cfg = pipeline_config(context)
        day = run_day(context)
        return validate_window(cfg, cfg.data.lake_uri, day, base_days(cfg, day), log_to_mlflow=True)

    @task
    def train(report: dict, **context) -> dict:
        from pipelines.training.base_model import train as run_train

        cfg = pipeline_config(context)
        return run_train(cfg, cfg.data.lake_uri, run_day(context))

    @task(retries=0, **registry_write())
    def register(trained: dict, **context) -> dict:
        from ctr_airflow.operators import emit_move
        from pipelines.flows.base import register_base as run_register

        out = run_register(pipeline_config(context), trained, actor=actor(context))
        emit_move(context, out["move"])   # mlflow://ctr_base/champion: adapters must follow a new base
        return out

    register(train(validate()))


ctr_base_model()
