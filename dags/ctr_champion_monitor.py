"""
### CTR champion monitor (daily, when the day's partition is validated)

Watches what serves, on each newly arrived labelled partition (delayed feedback: a day's clicks
arrive with its partition). Scheduled on the Asset `ctr_lake_validated`, which `ctr_lake_arrival`
emits once the day's partition has arrived and passed validation (unpausing starts nothing until the
next one). For the run's day `D` (the `day` param of a manual run, else the `day` of the triggering
event on that event's lake, else the logical date of `airflow dags test <dag> <date>`; a run that
consumed several validated days, e.g. during a backfill of `ctr_lake_arrival`, handles each of
them in turn, oldest first, one window per day):

1. **validate** the partition `dt=D` (GX suite, marker `_validation.json`); a quarantined
   partition stops the run here: nothing is scored, no alias moves.
2. **monitor** scores every adapter's `@champion` and `@canary` (`ctr_lora_<slot>` on its slot's
   rows, the cold-start adapter on all rows) on `D`, plus live metrics from Prometheus when
   `gate.live_metrics_url` is set. Each window is a run in the MLflow experiment `ctr-monitor`,
   recorded once (re-running a day reuses it). A version is not scored on days it was trained on.
   - canary no worse than the champion (AUC, `canary_auc_tolerance`) for `canary_healthy_windows`
     windows => promoted to `@champion`; worse in the latest window => withdrawn. Both moves are
     in the alias history with the windows and numbers as the reason.
   - champion metric (`revert_metric`) down more than `revert_drop` vs its reference for
     `revert_windows` consecutive windows => a revert is due.
   The decision table (every model, including waits and skips) is in this task's log.
3. **reverts_due** -> **auto_revert** (mapped, one per revert due; none on a healthy day) moves `@champion` back to
   the previous champion with the revert operator, the reason naming the windows.
4. **check** (next to auto_revert) fails the run when a model could not be monitored (the others
   still were).

Thresholds: `configs/gate_policy.yaml`. Triggered by the same event as `ctr_lora_retrain` and
`ctr_cold_start`; the order between them does not change a decision: a version is never scored on
the days it was trained on, so a canary released by today's retrain is first scored tomorrow.
"""

from __future__ import annotations


from ctr_airflow.assets import VALIDATED
from ctr_airflow.dag_defaults import ctr_dag, ctr_task, day_param, lake_uri_param
from ctr_airflow.operators import RevertModelVersionOperator, registry_write
from ctr_airflow.runtime import actor, pipeline_config, run_days


# Data-aware: one window per validated day (ctr_lake_arrival), not a clock; a missed day is monitored by
# hand with `day` (catchup is moot for an asset schedule; kept False so a return to a clock schedule
# cannot score years of history in one go). One run at a time: decisions read the windows of earlier days.
@ctr_dag(
    "ctr_champion_monitor",
    __doc__,
    schedule=[VALIDATED],
    tags=["monitor", "registry"],
    max_active_runs=1,
    params={
        "day": day_param(
            "Partition to monitor (default: the validated day that triggered the run, else the logical date)"
        ),
        "lake_uri": lake_uri_param(),
    },
)
def ctr_champion_monitor():
    # Bad data fails the same way on every try: ctr_task fails it without retrying (a DataValidationError).
    @ctr_task
    def validate(**context) -> dict:
        from pipelines.validation.stage import validate_window

        cfg = pipeline_config(context)
        days = run_days(context)  # several when the run consumed several validated days
        return {d: validate_window(cfg, cfg.data.lake_uri, d, 1, log_to_mlflow=True) for d in days}

    # Re-running is safe (windows are found, canary moves carry per-day op ids). It moves canaries: a registry
    # write like the others, in their one-slot pool.
    @ctr_task(**registry_write())
    def monitor(report: dict, **context) -> dict:
        from ctr_airflow.operators import emit_move
        from pipelines.config import load_gate_policy
        from pipelines.promotion import live_metrics
        from pipelines.promotion.monitor import monitor_days

        cfg, policy = pipeline_config(context), load_gate_policy()
        result = monitor_days(
            cfg,
            policy,
            cfg.data.lake_uri,
            run_days(context),
            live=live_metrics.from_policy(policy),
            actor=actor(context),
            apply_reverts=False,
        )
        for model in result["models"]:
            for move in model["moves"]:
                emit_move(context, move)  # the asset event deployments schedule on, like every alias move
        return result

    @ctr_task
    def reverts_due(result: dict) -> list[dict]:
        return result["reverts"]

    @ctr_task
    def check(result: dict) -> None:
        from pipelines.errors import PipelineError

        errors = result["errors"]
        if errors:
            raise PipelineError(
                f"{len(errors)} models could not be monitored: "
                + "; ".join(f"{e['model']}: {e['error']}" for e in errors)
            )

    monitored = monitor(validate())
    # One revert per model due (an empty list maps to no task). The target version is fixed by the
    # monitor, so a retried revert finds it done instead of popping the history a second time.
    # pool and outlets are given here: a mapped operator's __init__ defaults only apply once unmapped,
    # after the scheduler has already picked the pool.
    RevertModelVersionOperator.partial(task_id="auto_revert", **registry_write()).expand_kwargs(reverts_due(monitored))
    # A leaf of its own, next to auto_revert: it runs on days without reverts, and a refused revert
    # still fails the run through its own task.
    check(monitored)


ctr_champion_monitor()
