"""
### CTR model operations (manual)

Trigger with a form to **revert** a model's `@champion` to the previous champion (or a named
version), or to **promote** a gated version. A reason is required and recorded with the operator
and the run in the alias history (`python -m pipelines history --model NAME`). Refused moves
(version missing, never passed its gate, incompatible base) fail the task with the reason.
"""
from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import Param, dag, task

from ctr_airflow.operators import PromoteModelVersionOperator, RevertModelVersionOperator


@dag(
    dag_id="ctr_model_ops",
    schedule=None,
    start_date=pendulum.datetime(1997, 1, 1, tz="UTC"),  # early: backtests run on historical days (MovieLens is 1997-98)
    catchup=False,
    doc_md=__doc__,
    tags=["ctr", "ops", "registry", "manual"],
    default_args={"retries": 0, "retry_delay": timedelta(minutes=1), "owner": "ctr-ml"},
    render_template_as_native_obj=True,
    params={
        "action": Param("revert", type="string", enum=["revert", "promote"]),
        "model": Param("ctr_lora_morning", type="string", pattern="^ctr_(base|lora_[a-z0-9_]+)$",
                       description="Registered model name, e.g. ctr_lora_<slot>"),
        "version": Param(None, type=["null", "integer"], minimum=1,
                         description="Target version (revert: optional, default the previous champion)"),
        "reason": Param(type="string", minLength=5, description="Why (recorded in the alias history)"),
    },
)
def ctr_model_ops():
    @task.branch
    def choose(params: dict) -> str:
        return params["action"]

    revert = RevertModelVersionOperator(task_id="revert", model="{{ params.model }}",
                                        to_version="{{ params.version }}", reason="{{ params.reason }}")
    promote = PromoteModelVersionOperator(task_id="promote", model="{{ params.model }}",
                                          version="{{ params.version }}", reason="{{ params.reason }}")
    choose() >> [revert, promote]


ctr_model_ops()
