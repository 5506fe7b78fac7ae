"""The live stack of tests/e2e/test_stack.py: `scripts/stack.py up` (what `make stack` runs) under a throwaway
name, ports and bucket, with a MovieLens lake up to `LAKE_LAST_DAY`, and the module's readers of it (REST client,
registry, answered approvals). `down --purge` removes it all afterwards."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from mlflow import MlflowClient

from pipelines.promotion import aliases
from tests.conftest import free_port
from tests.e2e.airflow_rest import AirflowREST
from tests.e2e.stack import CANARY, JUDGE_PASSABLE, REPO, movielens_lake, paths_policy, pipeline_config, this_process_on

DAILY = ("ctr_lora_retrain", "ctr_cold_start", "ctr_champion_monitor")
LAKE_LAST_DAY = "1998-03-04"  # the arrivals stop at 1998-03-03; the browser test retrains the day after by hand


_LIVE_NAME: list[str] = []  # the module's stack name (its workers are <name>-worker-<i>@host)


class LiveStack:
    def __init__(self, env: dict, tmp: Path):
        self.env, self.tmp = env, tmp
        self.dir = Path(env["STACK_DIR"])

    def cli(self, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(REPO / "scripts" / "stack.py"), *args],
            env=self.env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def service_env(self) -> dict:
        out = self.cli("env").stdout
        return {k: shlex.split(v)[0] for k, v in re.findall(r"^export (\w+)=(.*)$", out, flags=re.M)}

    @property
    def airflow_url(self) -> str:
        return f"http://127.0.0.1:{self.env['STACK_API_PORT']}"

    def admin_password(self) -> str:
        return json.loads((self.dir / "airflow" / "passwords.json").read_text())["admin"]

    def rest(self) -> AirflowREST:
        return AirflowREST(self.airflow_url, "admin", self.admin_password())

    def worker_log(self, worker: str) -> str:
        return (self.dir / "logs" / f"{worker}.log").read_text(errors="replace")


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stack")
    name = f"ctr_e2e_{uuid.uuid4().hex[:8]}"
    _LIVE_NAME[:] = [name]
    bucket = name.replace("_", "-")
    # every release waits for a person (answered through the REST API below); the day-3 canary paths run
    paths_policy(tmp / "gate_policy.yaml", approval=True, **CANARY, **JUDGE_PASSABLE)
    env = {
        **os.environ,
        "STACK_NAME": name,
        "STACK_DIR": str(tmp / "stack"),
        "STACK_BUCKET": bucket,
        "STACK_S3_PORT": str(free_port()),
        "STACK_MLFLOW_PORT": str(free_port()),
        "STACK_API_PORT": str(free_port()),
        "STACK_SERVE_PORT": str(free_port()),
        "STACK_LOG_PORTS": ",".join(str(free_port()) for _ in range(4)),
        "STACK_REDIS_URL": "redis://127.0.0.1:6379/13",
        "STACK_LOAD_MOVIELENS": "0",
        "CTR_PIPELINE_CONFIG": str(tmp / "pipeline.yaml"),
        "CTR_GATE_POLICY": str(tmp / "gate_policy.yaml"),
        "CTR_TORCH_THREADS": "1",
    }
    st = LiveStack(env, tmp)
    cold_start = {"window_days": 45, "history_days": 60}
    pipeline_config(tmp, f"s3://{bucket}/clicks", cold_start=cold_start)  # the scoring server reads it at start
    try:
        up = st.cli("up")
        assert up.returncode == 0, up.stdout + up.stderr
        st.up_output = up.stdout
        svc = st.service_env()
        # The lake (MovieLens 1997-11-01..DAY3) and the smaller test config, written from here
        # into the stack's S3: the workers read both at task time.
        with this_process_on(
            svc["MLFLOW_TRACKING_URI"],
            AWS_ENDPOINT_URL=svc["AWS_ENDPOINT_URL"],
            AWS_ACCESS_KEY_ID=svc["AWS_ACCESS_KEY_ID"],
            AWS_SECRET_ACCESS_KEY=svc["AWS_SECRET_ACCESS_KEY"],
            MLFLOW_S3_ENDPOINT_URL=svc["AWS_ENDPOINT_URL"],
            CTR_REGISTRY_LOCK_URL=svc["CTR_REGISTRY_LOCK_URL"],
        ):
            movielens_lake(tmp, bucket, LAKE_LAST_DAY, cold_start=cold_start)
            # The DAG files read the pipeline config when parsed (the lake_uri form field): wait until the DAG
            # processor has parsed every DAG.
            st.rest().wait_for_dags(["ctr_base_model", "ctr_model_ops", "ctr_lake_arrival", *DAILY])
            yield st
    finally:
        down = st.cli("down", "--purge")
        print(down.stdout, down.stderr)


def approve_all(rest: AirflowREST, dag_id: str, run_id: str, answered: list, reject: set = frozenset()):
    """Answer each open approval of a run through `PATCH .../hitlDetails`, as a person in the UI would."""

    def poll():
        for detail in rest.pending_approvals(dag_id, run_id):
            option = "Reject" if any(m in (detail.get("body") or "") for m in reject) else "Approve"
            rest.answer(detail, option)
            answered.append((detail["task_instance"]["map_index"], option))

    return poll


def versions(name: str) -> list:
    return sorted(MlflowClient().search_model_versions(f"name = '{name}'"), key=lambda v: int(v.version))


def alias_of(name: str, alias: str = "champion") -> str | None:
    return aliases.current(name, alias)


def worker_prefix() -> str:
    return f"{_LIVE_NAME[0]}-worker-"
