"""
### CTR model operations (manual)

Trigger with a form to
- **revert** a model's `@champion` to the previous champion (or a named version),
- **promote** a gated version to `@champion`,
- **override** a gate rejection: release a rejected version to `@champion` (a reason is mandatory;
  base compatibility is still enforced and cannot be overridden),
- **promote_canary** / **withdraw_canary**: end a canary by hand.

The form is validated before any task runs (model name pattern, version an integer >= 1, reason
5 to 1,000 characters). The reason, the user and the run are recorded in the alias history
(`python -m pipelines history --model NAME`) and every move emits `mlflow://<model>/<alias>`.
Refused moves (version missing, never passed its gate, rejected by a person, no recorded approval
where the gate policy asks for one, incompatible base) fail with the reason.
"""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import Param, task

from ctr_airflow.dag_defaults import ctr_dag, reason_param
from ctr_airflow.operators import (
    OverrideGateOperator,
    PromoteCanaryOperator,
    PromoteModelVersionOperator,
    RevertModelVersionOperator,
    WithdrawCanaryOperator,
)

# Every operator reads the same form, rendered as text (a native rendering turns a reason "12345" into an
# int); the operator coerces each field to its type (`_version`, `_text`).
MODEL, VERSION, REASON = "{{ params.model }}", "{{ params.version }}", "{{ params.reason }}"


# A person waits on the answer: short retries (a refused move fails at once, see ctr_airflow.operators).
@ctr_dag(
    "ctr_model_ops",
    __doc__,
    schedule=None,
    tags=["ops", "registry", "manual"],
    retry_delay=timedelta(seconds=20),
    params={
        "action": Param(
            "revert", type="string", enum=["revert", "promote", "override", "promote_canary", "withdraw_canary"]
        ),
        "model": Param(
            "ctr_lora_morning",
            type="string",
            pattern="^ctr_(base|lora_[a-z0-9_]+)$",
            description="Registered model name, e.g. ctr_lora_<slot>",
        ),
        "version": Param(
            None,
            type=["null", "integer"],
            minimum=1,
            description="Target version (revert: optional, default the previous champion; "
            "promote / override: required)",
        ),
        "reason": reason_param("Why (recorded in the alias history)"),
    },
)
def ctr_model_ops():
    @task.branch
    def choose(params: dict) -> str:
        return params["action"]

    choose() >> [
        RevertModelVersionOperator(task_id="revert", model=MODEL, to_version=VERSION, reason=REASON),
        PromoteModelVersionOperator(task_id="promote", model=MODEL, version=VERSION, reason=REASON),
        OverrideGateOperator(task_id="override", model=MODEL, version=VERSION, reason=REASON),
        PromoteCanaryOperator(task_id="promote_canary", model=MODEL, reason=REASON),
        WithdrawCanaryOperator(task_id="withdraw_canary", model=MODEL, reason=REASON),
    ]


ctr_model_ops()
