"""
### CTR LoRA retrain (daily, when the day's partition is validated)

Scheduled on the Asset `ctr_lake_validated`: `ctr_lake_arrival` emits it once the day's click-log
partition has arrived and passed validation, so a run never starts on a day the lake does not have
(unpausing this DAG starts nothing until the next such event). For the run's day `D` (the `end_day`
param of a manual run, else the `day` of the triggering event on that event's lake, the newest one
when several days were queued into one run, else the logical date of `airflow dags test <dag> <date>`):

1. **validate** every click-log partition in the trailing window ending at `D` with the GX suite;
   any failure stops the run here: nothing trains, nothing is registered, `@champion` is untouched.
2. **train_adapter** one LoRA adapter per configured slot (mapped), on the frozen serving base
   (`ctr_base@champion`), over the window's older rows.
3. **evaluate** candidate and serving `ctr_lora_<slot>@champion` on the same newest rows.
4. **register** the candidate with lineage tags, a model card and alias `candidate` (idempotent:
   the same data, config and code return the existing version).
5. **gate_and_promote**: the gate (`configs/gate_policy.yaml`): non-inferiority against the serving
   champion (AUC, logloss, per slot, optional DeLong superiority), fairness gaps, calibration,
   latency, base compatibility. A rejection skips the task (the champion is untouched). A pass is
   released to `@canary` (`promotion: canary`; `ctr_champion_monitor` then promotes or withdraws it)
   or to `@champion`; the first version of a model always becomes `@champion`.
   With `approval: true` in the policy, the task group **approval** (mapped, one per candidate) runs
   **gate_and_promote** without releasing, then **approve_release** (Airflow's human-in-the-loop:
   the UI's Required Actions) and **release**, which moves the alias only after a recorded
   "Approve" and records the approver. Rejecting one slot's candidate skips only that slot.
   The policy is read when this file is parsed: a policy that cannot be read is an import error of
   this DAG (shown in the UI), never a DAG without its approval step. The release enforces the policy
   again when it runs (no approval, a person's rejection, a stale gate: refused).

**Judged on the next days** (`lora.judged_on: next_day` in the pipeline config; read when this file is
parsed): **judge** (mapped per slot) scores the slot's waiting candidates and `@champion` on `D`'s rows (the
rows they train on) and adds the paired per-row logloss differences to each candidate's evidence
(`promotion.prequential`, a confidence sequence valid at every daily look); a safety check or the test rejects
at once, a candidate the evidence lets go is tagged ready, the rest wait. **train_adapter** trains `D`'s
candidate on its whole window,
`D` included, and **register** registers it waiting. **hand_over** names what to release: the ready candidate,
or with `judge_release: successor` `D`'s candidate in its place; **gate_and_promote** (or **approval**) gates
and releases it as above. Nothing is gated at registration.

Every alias move is recorded in the alias history and emits the Asset event
`mlflow://<model>/<alias>`. Registry writes run in the one-slot pool `ctr_registry`.
"""

from __future__ import annotations

from airflow.sdk import task_group

from ctr_airflow.approval import GROUP as APPROVAL_GROUP
from ctr_airflow.approval import gate_approve_release
from ctr_airflow.assets import VALIDATED
from ctr_airflow.dag_defaults import ctr_dag, ctr_task, day_param, lake_uri_param
from ctr_airflow.operators import GatedPromotionOperator, registry_write
from ctr_airflow.runtime import actor, approval_required, judged_next_day, pipeline_config, run_day


# Data-aware: one run per validated day (ctr_lake_arrival), not a clock; a missed day is retrained by hand
# with end_day (backfilling old windows is rarely wanted).
@ctr_dag(
    "ctr_lora_retrain",
    __doc__,
    schedule=[VALIDATED],
    tags=["lora", "training", "registry"],
    max_active_runs=1,
    params={
        "end_day": day_param(
            "Last day of the training window (default: the validated day that triggered the run, else the logical date)"
        ),
        "lake_uri": lake_uri_param(),
    },
)
def ctr_lora_retrain():
    # Bad data fails the same way on every try: ctr_task fails it without retrying (a DataValidationError).
    @ctr_task
    def validate(**context) -> dict:
        from pipelines.flows.windows import adapter_days
        from pipelines.validation.stage import validate_window

        cfg = pipeline_config(context)
        return validate_window(cfg, cfg.data.lake_uri, run_day(context), adapter_days(cfg), log_to_mlflow=True)

    @ctr_task
    def slots(report: dict, **context) -> list[str]:
        return list(pipeline_config(context).data.slots)

    @ctr_task
    def train_adapter(slot: str, **context) -> dict:
        from pipelines.training.adapter import train

        cfg = pipeline_config(context)
        return train(cfg, cfg.data.lake_uri, run_day(context), slot).to_dict()  # XCom holds JSON

    @ctr_task
    def evaluate(candidate: dict, **context) -> dict:
        from pipelines.evaluation.compare import evaluate as run_eval

        cfg = pipeline_config(context)
        return {"candidate": candidate, "evaluation": run_eval(cfg, cfg.data.lake_uri, candidate)}

    # Writes the verdicts (evidence, rejections) on the versions: a registry write, in the registry pool.
    @ctr_task(**registry_write(moves=False))
    def judge(slot: str, **context) -> dict:
        from pipelines.config import load_gate_policy
        from pipelines.promotion import prequential

        cfg = pipeline_config(context)
        return prequential.judge_slot(
            cfg, load_gate_policy(), cfg.data.lake_uri, run_day(context), slot, actor=actor(context)
        )

    @ctr_task(**registry_write(moves=False))
    def hand_over(registered: dict) -> dict:
        from pipelines.config import load_gate_policy
        from pipelines.promotion import prequential

        return prequential.hand_over(load_gate_policy(), registered)

    @ctr_task(**registry_write(moves=False))
    def register(evaluated: dict, **context) -> dict:
        from pipelines.registry.register import register as run_register

        return run_register(pipeline_config(context), evaluated["candidate"], evaluated["evaluation"])

    slot_list = slots(validate())
    if judged_next_day():
        _prequential(slot_list, judge, train_adapter, evaluate, register, hand_over)
        return
    trained = train_adapter.expand(slot=slot_list)
    _gate_and_release(register.expand(evaluated=evaluate.expand(candidate=trained)))


def _prequential(slot_list, judge, train_adapter, evaluate, register, hand_over) -> None:
    """lora.judged_on next_day: judge the waiting candidates >> train today's >> register it (waiting) >> hand over
    what the judge let go (promotion.prequential.hand_over) >> gate and release it."""
    trained = train_adapter.expand(slot=slot_list)
    judge.expand(slot=slot_list) >> trained
    _gate_and_release(hand_over.expand(registered=register.expand(evaluated=evaluate.expand(candidate=trained))))


def _gate_and_release(registered) -> None:
    """Gate each candidate and release it on a pass: through the approval group when the policy asks for one."""
    if approval_required():
        # gate >> approval >> release per candidate, paired by map index (see ctr_airflow.approval)
        @task_group(group_id=APPROVAL_GROUP)
        def approval(registered: dict):
            gate_approve_release(registered, what="CTR adapter")

        approval.expand(registered=registered)
    else:
        # .partial() does not run __init__, so the pool and the asset alias are named here as well
        GatedPromotionOperator.partial(task_id="gate_and_promote", **registry_write()).expand(registered=registered)


ctr_lora_retrain()
