"""What tasks need from their Airflow context: the day a run is about, who acted, S3 settings.

Kept free of heavy imports: DAG files import this at parse time.
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

LAKE_CONN_ID_ENV = "CTR_LAKE_AWS_CONN_ID"


def run_day(context) -> str:
    """The partition date a run is about: `params.end_day`, else the logical date, else run_after."""
    params = context.get("params") or {}
    if params.get("end_day"):
        return str(params["end_day"])
    if context.get("ds"):
        return context["ds"]
    dag_run = context.get("dag_run")
    return dag_run.run_after.date().isoformat()


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
    """The pipeline config for this run: the YAML file plus `params.lake_uri` when given."""
    from pipelines.config import load_pipeline_config

    apply_aws_connection()
    params = context.get("params") or {}
    overrides = {"data": {"lake_uri": params["lake_uri"]}} if params.get("lake_uri") else None
    return load_pipeline_config(overrides=overrides)


def approval_required() -> bool:
    """Whether the gate policy asks for a human approval before a release (read at parse time: it
    decides the DAG's shape; the policy file is small YAML, no heavy imports)."""
    from pipelines.config import load_gate_policy

    try:
        return load_gate_policy().approval
    except Exception as exc:  # a broken policy file must not hide the DAG: the gate task will report it
        log.warning("gate policy unreadable at parse time (%s); assuming no approval step", exc)
        return False
