"""MLflow's usage telemetry is off in every process the product starts: no usage events leave machines that
hold ad data, and no background thread writes os.environ while MLflow logs.

The race is real: with telemetry on, MLflow's telemetry thread sets and then unsets
`_MLFLOW_TELEMETRY_SESSION_ID` (its config fetch fails without egress), so a thread iterating the
environment meanwhile raises KeyError, which is how a training task's first try failed in MLflow's
log-batch. The subprocesses below run without the variables by which MLflow turns telemetry off under
pytest and CI, so they meet MLflow as a user's worker does."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import yaml

from tests.e2e.stack import REPO

SESSION_VAR = "_MLFLOW_TELEMETRY_SESSION_ID"
CI_MARKERS = (
    "PYTEST_CURRENT_TEST",
    "PYTEST_XDIST_WORKER",
    "CI",
    "GITHUB_ACTIONS",
    "MLFLOW_DISABLE_TELEMETRY",
    "DO_NOT_TRACK",
)

# Logs runs while a second thread reads the whole environment in a loop; prints what it saw.
RACE = textwrap.dedent("""
    import json, os, sys, threading
    if sys.argv[1] == "product":
        import pipelines   # what every entry point, DAG task and worker imports before MLflow logs
    import mlflow
    seen_var = os.environ.get("%(var)s") is not None
    mlflow.set_tracking_uri(sys.argv[2])
    errors, stop = [], threading.Event()
    def read_env():
        while not stop.is_set():
            try:
                for k in os.environ:
                    os.environ[k]
            except (KeyError, RuntimeError) as e:
                errors.append(repr(e))
    reader = threading.Thread(target=read_env)
    reader.start()
    for i in range(5):
        with mlflow.start_run():
            mlflow.log_metrics({"auc": 0.7, "logloss": 0.6}, step=i)
    stop.set()
    reader.join()
    print(json.dumps({"errors": errors, "session_var_seen": seen_var}))
""") % {"var": SESSION_VAR}


def _race(mode: str, tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in CI_MARKERS}
    out = subprocess.run(
        [sys.executable, "-c", RACE, mode, f"sqlite:///{tmp_path / 'mlflow.db'}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_mlflow_logging_beside_environment_readers_never_races_in_the_product(tmp_path):
    seen = _race("product", tmp_path)
    assert seen == {"errors": [], "session_var_seen": False}


@pytest.mark.slow
def test_with_telemetry_on_the_same_logging_races_the_environment(tmp_path):
    """The control: what the product's setting prevents happens without it (MLflow 3.17, no egress)."""
    seen = _race("mlflow_default", tmp_path)
    assert seen["session_var_seen"], "MLflow no longer exports its telemetry session: re-check the race"
    assert any(SESSION_VAR in e for e in seen["errors"]), seen


def test_every_environment_the_product_starts_turns_telemetry_off(tmp_path):
    spec = importlib.util.spec_from_file_location("stack_script", REPO / "scripts" / "stack.py")
    stack = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stack)
    assert stack.stack_env(stack.settings({"STACK_DIR": str(tmp_path)}), {})["MLFLOW_DISABLE_TELEMETRY"] == "true"
    embedded = subprocess.run(
        ["bash", "-c", "source scripts/env.sh && echo $MLFLOW_DISABLE_TELEMETRY"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"]},
    )
    assert embedded.stdout.strip() == "true"
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    runs_mlflow = [n for n, s in compose["services"].items() if "airflow" in n or n.startswith(("mlflow", "serving"))]
    assert {"mlflow", "serving", "serving-init", "airflow-worker", "airflow-scheduler"} <= set(runs_mlflow)
    assert {
        n: compose["services"][n]["environment"].get("MLFLOW_DISABLE_TELEMETRY") for n in runs_mlflow
    } == dict.fromkeys(runs_mlflow, "true")
    for image in ("Dockerfile", "mlflow.Dockerfile"):
        assert "ENV MLFLOW_DISABLE_TELEMETRY=true" in (REPO / "docker" / image).read_text(), image


def test_importing_the_package_turns_it_off_unless_a_user_chose(tmp_path):
    code = "import os, pipelines; print(os.environ['MLFLOW_DISABLE_TELEMETRY'])"
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_DISABLE_TELEMETRY"}
    got = [
        subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, env={**env, **extra}, capture_output=True, text=True
        ).stdout.strip()
        for extra in ({}, {"MLFLOW_DISABLE_TELEMETRY": "false"})
    ]
    assert got == ["true", "false"]
