"""What tasks need from their Airflow context: the day a run is about, which lake, who acted, S3 settings.

Kept free of heavy imports: DAG files import this at parse time.
"""

from __future__ import annotations

import logging
import os

from ctr_airflow.assets import VALIDATED

log = logging.getLogger(__name__)

LAKE_CONN_ID_ENV = "CTR_LAKE_AWS_CONN_ID"


def validated_event(context) -> dict | None:
    """The extra (`day`, `lake_uri`) of the `ctr_lake_validated` event this run was triggered by.

    A run consumes every event recorded since the DAG's previous asset-triggered run up to the one
    that queued it, so it can have several (days validated while the DAG was paused, or within one
    scheduler loop): the newest day wins, not the latest event (it is the end of the window and the
    older days are inside it); the latest event breaks a tie (a day validated twice, maybe in another
    lake). None for a run that no such event triggered (manual, `airflow dags test`, cron).
    """
    events = context.get("triggering_asset_events") or {}
    found = [e for e in events.get(VALIDATED, ()) if (e.extra or {}).get("day")]
    if not found:
        return None
    newest = max(found, key=lambda e: (str(e.extra["day"]), e.timestamp))
    return dict(newest.extra)


def run_day(context) -> str:
    """The partition date a run is about, the first of:

    1. `params.end_day` / `params.day`: a run triggered by hand for that day;
    2. the day of the `ctr_lake_validated` event that triggered the run: asset-triggered runs have
       no logical date (`validated_event`);
    3. the logical date: `airflow dags test <dag> <date>`, a cron run, a UI trigger with a date;
    4. run_after.
    """
    params = context.get("params") or {}
    for key in ("end_day", "day"):
        if params.get(key):
            return str(params[key])
    event = validated_event(context)
    if event:
        return str(event["day"])
    if context.get("ds"):
        return context["ds"]
    dag_run = context.get("dag_run")
    return dag_run.run_after.date().isoformat()


def run_days(context) -> list[str]:
    """Every day a run is about, oldest first: for a run that consumed several `ctr_lake_validated`
    events (days validated while it was busy or paused, e.g. during a backfill), each of their days in
    the lake of the newest event; otherwise `[run_day(context)]`. For the monitor, whose windows are
    days: the retrain and cold start train on the newest window, which holds the older days."""
    params = context.get("params") or {}
    newest = None if any(params.get(k) for k in ("end_day", "day")) else validated_event(context)
    if not newest:
        return [run_day(context)]
    events = (context.get("triggering_asset_events") or {}).get(VALIDATED, ())
    lake = newest.get("lake_uri")
    return sorted(
        {str(e.extra["day"]) for e in events if (e.extra or {}).get("day") and (e.extra or {}).get("lake_uri") == lake}
    )


def lake_override(context) -> str | None:
    """The lake this run reads instead of the config's: `params.lake_uri`, else the lake named by the
    triggering `ctr_lake_validated` event (a partition validated in lake X is trained on in lake X)."""
    params = context.get("params") or {}
    if params.get("lake_uri"):
        return str(params["lake_uri"])
    return (validated_event(context) or {}).get("lake_uri") or None


def actor(context) -> str:
    """Who moved an alias: the triggering user when Airflow knows it, plus the DAG run."""
    dag_run = context.get("dag_run")
    user = getattr(dag_run, "triggering_user_name", None) if dag_run else None
    where = f"airflow:{dag_run.dag_id}/{dag_run.run_id}" if dag_run else "airflow"
    return f"{user} via {where}" if user else where


def apply_aws_connection() -> None:
    """Point boto3 at the lake's endpoint from an Airflow AWS connection, if one is named.

    `CTR_LAKE_AWS_CONN_ID` names the connection (e.g. `aws_default`); its `endpoint_url` extra and
    credentials become the standard AWS_* variables for this task process. Without it, the process
    environment (AWS_ENDPOINT_URL, ...) is used as is, so the same code runs on AWS, MinIO or moto.
    """
    conn_id = os.environ.get(LAKE_CONN_ID_ENV)
    if not conn_id:
        return
    from airflow.sdk import BaseHook

    conn = BaseHook.get_connection(conn_id)
    extra = conn.extra_dejson or {}
    if extra.get("endpoint_url"):
        os.environ["AWS_ENDPOINT_URL"] = os.environ["MLFLOW_S3_ENDPOINT_URL"] = extra["endpoint_url"]
    if conn.login:
        os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"] = conn.login, conn.password or ""
    if extra.get("region_name"):
        os.environ["AWS_DEFAULT_REGION"] = extra["region_name"]
    log.info("lake S3 settings from Airflow connection %r (endpoint %s)", conn_id, extra.get("endpoint_url", "default"))


def pipeline_config(context):
    """The pipeline config for this run: the YAML file, with the lake of `lake_override` when there is one.
    A lake that is neither `data.lake_uri` nor in `data.allowed_lakes` raises ConfigError (the form
    field refuses it when the run is triggered, `lake_uri_param`; this also covers a triggering event)."""
    from pipelines.config import load_pipeline_config

    apply_aws_connection()
    cfg = load_pipeline_config()
    lake = lake_override(context)
    return load_pipeline_config(overrides={"data": {"lake_uri": cfg.data.checked_lake(lake)}}) if lake else cfg


def approval_required() -> bool:
    """Whether the gate policy asks for a human approval before a release (read at parse time: it
    decides the DAG's shape; the policy file is small YAML, no heavy imports).

    A policy that cannot be read raises (a ConfigError): the DAG file fails to import and the UI shows
    the import error. Guessing a shape instead would serve a silently different DAG. The release
    enforces the policy again when it runs (`pipelines.promotion.release`), whatever shape was parsed."""
    from pipelines.config import load_gate_policy

    return load_gate_policy().approval


def judged_next_day() -> bool:
    """Whether adapters are judged on the days after their window (`lora.judged_on: next_day` in the pipeline
    config): read at parse time, as `approval_required`, because it decides the DAG's shape (judge, release,
    then train; no gate after registration). A config that cannot be read is an import error of the DAG."""
    from pipelines.config import load_pipeline_config

    return load_pipeline_config().lora.judged_on == "next_day"
