"""
### CTR model operations (manual)

Trigger with a form to
- **revert** a model's `@champion` to the previous champion (or a named version),
- **promote** a gated version to `@champion`,
- **override** a gate rejection: release a rejected version to `@champion` (a reason is mandatory;
  base compatibility is still enforced and cannot be overridden),
- **promote_canary** / **withdraw_canary**: end a canary by hand.

The form is validated before any task runs (model name pattern, version an integer >= 1, reason
at least 5 characters). The reason, the user and the run are recorded in the alias history
(`python -m pipelines history --model NAME`) and every move emits `mlflow://<model>/<alias>`.
Refused moves (version missing, never passed its gate, incompatible base) fail with the reason.
"""
from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import Param, dag, task

from ctr_airflow.operators import (MOVES, REGISTRY_POOL, OverrideGateOperator, PromoteModelVersionOperator,
                                   RevertModelVersionOperator)


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
        "action": Param("revert", type="string",
                        enum=["revert", "promote", "override", "promote_canary", "withdraw_canary"]),
        "model": Param("ctr_lora_morning", type="string", pattern="^ctr_(base|lora_[a-z0-9_]+)$",
                       description="Registered model name, e.g. ctr_lora_<slot>"),
        "version": Param(None, type=["null", "integer"], minimum=1,
                         description="Target version (revert: optional, default the previous champion; "
                                     "promote / override: required)"),
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
    override = OverrideGateOperator(task_id="override", model="{{ params.model }}",
                                    version="{{ params.version }}", reason="{{ params.reason }}")

    @task(task_id="promote_canary", pool=REGISTRY_POOL, outlets=[MOVES])
    def promote_canary(params: dict, **context) -> dict:
        from ctr_airflow.operators import emit_move, op_id
        from ctr_airflow.runtime import actor
        from pipelines.promotion import aliases

        move = aliases.promote_canary(params["model"], reason=params["reason"], actor=actor(context),
                                      op_id=op_id(context))
        emit_move(context, move)
        emit_move(context, move.get("withdrawn") or {})
        return move

    @task(task_id="withdraw_canary", pool=REGISTRY_POOL, outlets=[MOVES])
    def withdraw_canary(params: dict, **context) -> dict:
        from ctr_airflow.operators import emit_move, op_id
        from ctr_airflow.runtime import actor
        from pipelines.promotion import aliases

        move = aliases.withdraw_canary(params["model"], reason=params["reason"], actor=actor(context),
                                       op_id=op_id(context))
        emit_move(context, move)
        return move

    choose() >> [revert, promote, override, promote_canary(), withdraw_canary()]


ctr_model_ops()
