"""The settings of `make stack` (scripts/stack.py) and of docker-compose.yml agree on what matters
for a deployment: CeleryExecutor, one JWT secret, the registry lock URL on PostgreSQL, the lake's
connection, the worker preload, MLflow's logging and artifact proxying, the registry pool."""
from __future__ import annotations

import importlib.util
import shutil
import subprocess

import pytest
import yaml

from tests.e2e.stack import REPO

SHARED = ("AIRFLOW__CELERY__CELERY_CONFIG_OPTIONS", "MLFLOW_CONFIGURE_LOGGING", "CTR_LAKE_AWS_CONN_ID")


@pytest.fixture(scope="module")
def stack_mod():
    spec = importlib.util.spec_from_file_location("stack_script", REPO / "scripts" / "stack.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def test_stack_env_is_the_production_topology(stack_mod, tmp_path):
    s = stack_mod.settings({"STACK_DIR": str(tmp_path), "STACK_API_PORT": "18080", "STACK_NAME": "x"})
    env = stack_mod.stack_env(s, {"PATH": "/bin"})
    assert env["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor"
    assert env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] == "http://127.0.0.1:18080/execution/"
    assert env["CTR_REGISTRY_LOCK_URL"].startswith("postgresql://") and env["CTR_REGISTRY_LOCK_URL"].endswith("/x_mlflow")
    assert env["MLFLOW_TRACKING_URI"].startswith("http://127.0.0.1:")
    assert "CTR_MLFLOW_ARTIFACT_ROOT" not in env  # artifacts are proxied by the tracking server
    # one secret for every component, kept across restarts
    assert env["AIRFLOW__API_AUTH__JWT_SECRET"] == stack_mod.stack_env(s, {})["AIRFLOW__API_AUTH__JWT_SECRET"]
    # every log server on a port of its own (scheduler, triggerer, two workers)
    ports = {stack_mod.component_env(s, env, c)["AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT"] for c in ("worker-1", "worker-2")}
    ports |= {env["AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT"], env["AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT"]}
    assert len(ports) == 4
    mlflow_cmd = stack_mod.commands(s)["mlflow"]
    assert "--serve-artifacts" in mlflow_cmd and any(a.startswith("postgresql://") for a in mlflow_cmd)


def test_compose_uses_the_same_settings(stack_mod, compose, tmp_path):
    env = stack_mod.stack_env(stack_mod.settings({"STACK_DIR": str(tmp_path)}), {})
    common = compose["x-airflow-common"]["environment"]
    assert common["AIRFLOW__CORE__EXECUTOR"].endswith(":-CeleryExecutor}")
    assert common["CTR_REGISTRY_LOCK_URL"].startswith("postgresql://")
    for key in SHARED:
        assert str(common[key]) == env[key], key
    # the connection that CTR_LAKE_AWS_CONN_ID names exists, as an AWS connection to the lake's endpoint
    lake_conn = common[f"AIRFLOW_CONN_{common['CTR_LAKE_AWS_CONN_ID'].upper()}"]
    assert '"conn_type": "aws"' in lake_conn and '"endpoint_url": "http://minio:9000"' in lake_conn
    assert "--serve-artifacts" in compose["services"]["mlflow"]["command"]
    assert compose["services"]["airflow-worker"]["deploy"]["replicas"] == "${AIRFLOW_WORKERS:-2}"
    assert "profiles" not in compose["services"]["redis"]
    assert "airflow pools set ctr_registry 1" in compose["services"]["airflow-init"]["command"][1]


def test_compose_config_is_valid_where_the_plugin_exists():
    docker = shutil.which("docker")
    if not docker or subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("no `docker compose` plugin on this machine: the file is checked by the tests above only")
    proc = subprocess.run([docker, "compose", "-f", str(REPO / "docker-compose.yml"), "config", "-q"],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
