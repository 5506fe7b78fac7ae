"""
### CTR lake arrival (daily): wait for the day's click-log partition, validate it, announce it

The start of every daily chain. For the run's day `D` (the logical date, or the `day` param):

1. **wait_for_partition** (`LakePartitionSensor`, reschedule mode) looks for `.parquet` objects
   under `<lake>/dt=D/` every 10 minutes, freeing its worker slot in between. If nothing arrives
   within a day (or `wait_timeout_s`), the task ends **skipped** (soft fail) and so does the rest
   of the run: a late or missing day never makes a red run. A lake that cannot be listed at all
   (no bucket, endpoint down, no access) fails the task: that is a broken deployment, not a late day.
2. **validate** runs the GX suite on `dt=D` (marker `_validation.json`, HTML report, MLflow
   experiment `ctr-data-validation`). Bad data fails the task (red run, partition quarantined) and
   nothing downstream is triggered. A valid partition emits the Asset event
   `ctr_lake_validated` with `extra={"day": D, "lake_uri": <lake>}`.

That event triggers `ctr_lora_retrain`, `ctr_cold_start` and `ctr_champion_monitor`, which run
for `D` on that lake. Unpausing this DAG starts (at most) one run for the latest 02:00 slot, which
waits for that day's partition. A past day by hand: Trigger with `day` (and `lake_uri`); a day that
is already in the lake passes the sensor at its first poke.
"""

from __future__ import annotations

from airflow.sdk import Param

from ctr_airflow.assets import VALIDATED
from ctr_airflow.dag_defaults import ctr_dag, ctr_task, day_param, lake_uri_param
from ctr_airflow.sensors import LakePartitionSensor


# Only the latest day on unpause (no catchup): a past day is validated by hand with `day`. Today's sensor
# may still be waiting when a past day is triggered by hand: let both run (max_active_runs=3).
@ctr_dag(
    "ctr_lake_arrival",
    __doc__,
    schedule="0 2 * * *",
    tags=["lake", "validation", "sensor"],
    max_active_runs=3,
    params={
        "day": day_param("Partition to wait for and validate (default: the logical date)"),
        "lake_uri": lake_uri_param(),
        "wait_timeout_s": Param(
            None,
            type=["null", "integer"],
            minimum=0,
            description="Give up waiting (the run ends skipped) after this many seconds (default: one day)",
        ),
    },
)
def ctr_lake_arrival():
    # Retries apply to a lake that cannot be listed (LakeUnreachable); the wait itself is the timeout,
    # counted from the first poke of the first try.
    arrived = LakePartitionSensor(task_id="wait_for_partition", wait_timeout_s="{{ params.wait_timeout_s }}")

    # Bad data fails the same way on every try: ctr_task fails it without retrying (a DataValidationError);
    # an S3 outage is retried. The asset event is only emitted when this task succeeds.
    @ctr_task(outlets=[VALIDATED])
    def validate(partition: dict, **context) -> dict:
        from ctr_airflow.runtime import pipeline_config
        from pipelines.validation.stage import validate_window

        cfg = pipeline_config(context)
        day, lake = partition["day"], partition["lake_uri"]  # exactly what the sensor found
        summary = validate_window(cfg, lake, day, 1, log_to_mlflow=True)
        context["outlet_events"][VALIDATED].extra = {"day": day, "lake_uri": lake}
        return summary

    validate(arrived.output)


ctr_lake_arrival()
