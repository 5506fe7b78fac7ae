"""
### CTR base model

Trains the frozen base CTR model from scratch on every validated partition from
`base_training.train_start` up to the run's day, registers it as `ctr_base` (tagged with the sha256
fingerprint of its weights) and makes it the serving base (`ctr_base@champion`). Adapters record
the base version and fingerprint they were trained on; a new base means adapters must be retrained.
Manual: a new base is a deliberate decision, not a schedule.
"""
from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import Param, dag, task

from ctr_airflow.operators import MOVES, REGISTRY_POOL
from ctr_airflow.runtime import actor, pipeline_config, run_day


@dag(
    dag_id="ctr_base_model",
    schedule=None,
    start_date=pendulum.datetime(1997, 1, 1, tz="UTC"),  # early: backtests run on historical days (MovieLens is 1997-98)
    catchup=False,
    doc_md=__doc__,
    tags=["ctr", "base-model", "training", "registry"],
    default_args={"retries": 1, "retry_delay": timedelta(minutes=5), "owner": "ctr-ml"},
    params={
        "end_day": Param(None, type=["null", "string"], format="date",
                         description="Training cutoff: last day of data the base sees (default: logical date)"),
        "lake_uri": Param(None, type=["null", "string"], pattern="^(s3://|/).+",
                          description="Override the click-log lake (default: configs/pipeline.yaml)"),
    },
)
def ctr_base_model():
    @task(retries=0)
    def validate(**context) -> dict:
        import datetime as dt

        from pipelines.validation.stage import validate_window

        cfg = pipeline_config(context)
        day = run_day(context)
        days = (dt.date.fromisoformat(day) - dt.date.fromisoformat(cfg.base_training.train_start)).days + 1
        return validate_window(cfg, cfg.data.lake_uri, day, days, log_to_mlflow=True)

    @task
    def train(report: dict, **context) -> dict:
        from pipelines.training.base_model import train as run_train

        cfg = pipeline_config(context)
        return run_train(cfg, cfg.data.lake_uri, run_day(context))

    @task(retries=0, pool=REGISTRY_POOL, outlets=[MOVES])
    def register(trained: dict, **context) -> dict:
        from ctr_airflow.operators import emit_move
        from pipelines.flows.base import register_base as run_register

        out = run_register(pipeline_config(context), trained, actor=actor(context))
        emit_move(context, out["move"])   # mlflow://ctr_base/champion: adapters must follow a new base
        return out

    register(train(validate()))


ctr_base_model()
