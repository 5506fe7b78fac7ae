"""Wait for a click-log partition to land in the lake, without holding a worker or failing a run.

`LakePartitionSensor` pokes `<lake>/dt=<day>/` for at least one `.parquet` object (one LIST request
through `pipelines.data.lake.Lake`: boto3 with AWS_ENDPOINT_URL, or the Airflow AWS connection named
by CTR_LAKE_AWS_CONN_ID, exactly like the tasks that read the partition later; or a local directory).

Why reschedule mode and not deferral: the check is one cheap LIST every 10 minutes, so what matters
is that the worker slot is free in between, which `mode="reschedule"` gives (the task process ends
and the scheduler starts a new poke when it is due). A deferrable version would need an async
trigger per lake kind (the Amazon provider's S3KeyTrigger for s3://, another for local lakes), S3
credentials and endpoint configured in the triggerer through an Airflow connection instead of the
code path every other task uses, and a triggerer running; for a 10-minute poll it saves nothing
worth that. Reschedule mode needs only the scheduler and works in `airflow dags test` too.

`soft_fail=True` (the default here): a day that never arrives within `timeout` (one day) ends the
task *skipped*, and with it the run's downstream tasks: the run is not failed and no asset event is
emitted. A lake that cannot be listed at all (no such bucket, endpoint down, access denied) is not a
missing day: it raises LakeUnreachable, which fails the task (and is retried), so a misconfigured
lake shows up red instead of as an endless series of skipped days.
"""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import BaseSensorOperator, PokeReturnValue
from airflow.sdk.exceptions import AirflowException

from ctr_airflow.runtime import apply_aws_connection, pipeline_config, run_day

POKE_INTERVAL = timedelta(minutes=10)
WAIT_TIMEOUT = timedelta(days=1)


class LakeUnreachable(AirflowException):
    """The lake itself cannot be listed. Deliberately not an AirflowFailException: soft_fail turns
    those into a skip, and a broken lake must fail the task, not look like a day without data."""


def _seconds(value) -> float | None:
    """A rendered `wait_timeout_s`: None, '' or 'None' (an unset param rendered as text) mean unset."""
    if value in (None, "", "None"):
        return None
    return float(value)


class LakePartitionSensor(BaseSensorOperator):
    """Succeeds once `<lake_uri>/dt=<day>/` holds a `.parquet` object; XCom: `{day, lake_uri, files}`.

    `day` defaults to the run's day (`ctr_airflow.runtime.run_day`), `lake_uri` to the run's lake
    (`pipeline_config`, i.e. `params.lake_uri` or configs/pipeline.yaml); both are resolved when the
    task runs, never at parse time. `wait_timeout_s` (templated) replaces `timeout` for one run,
    e.g. `"{{ params.wait_timeout_s }}"` so a test or a one-off backfill can give up quickly.
    """

    template_fields = ("day", "lake_uri", "wait_timeout_s")

    def __init__(
        self,
        *,
        day: str | None = None,
        lake_uri: str | None = None,
        wait_timeout_s: float | str | None = None,
        **kwargs,
    ):
        kwargs.setdefault("mode", "reschedule")
        kwargs.setdefault("poke_interval", POKE_INTERVAL)
        kwargs.setdefault("timeout", WAIT_TIMEOUT)
        kwargs.setdefault("soft_fail", True)
        super().__init__(**kwargs)
        self.day, self.lake_uri, self.wait_timeout_s = day, lake_uri, wait_timeout_s

    def execute(self, context):
        override = _seconds(self.wait_timeout_s)
        if override is not None:
            self.timeout = override
        # Without exponential backoff the next poke is poke_interval away, even past the timeout: a
        # 30 s timeout would give up only after 10 minutes. Never wait longer than the timeout.
        self.poke_interval = min(self.poke_interval, self.timeout)
        apply_aws_connection()  # also for an explicit lake_uri, which skips pipeline_config
        self.day = self.day or run_day(context)
        self.lake_uri = self.lake_uri or pipeline_config(context).data.lake_uri
        self.log.info(
            "waiting for %s/dt=%s (poke every %ss, give up after %ss)",
            self.lake_uri,
            self.day,
            self.poke_interval,
            self.timeout,
        )
        return super().execute(context)

    def poke(self, context) -> PokeReturnValue:
        """The partition's committed parts (its manifest; execute() has resolved day and lake_uri)."""
        from pipelines.data.lake import Lake
        from pipelines.errors import LakeError

        try:
            files = Lake(self.lake_uri).parquet_files(self.day)
        except LakeError as exc:
            raise LakeUnreachable(f"cannot look for dt={self.day} in {self.lake_uri}: {exc}") from exc
        if not files:
            self.log.info("dt=%s is not committed in %s yet (no manifest)", self.day, self.lake_uri)
        return PokeReturnValue(
            is_done=bool(files), xcom_value={"day": self.day, "lake_uri": self.lake_uri, "files": len(files)}
        )
