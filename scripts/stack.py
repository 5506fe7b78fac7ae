"""The production topology on one machine, no Docker: `make stack` / `make stack-down`.

    python scripts/stack.py up | down | status | env

Processes (each started here, its PID in <STACK_DIR>/pids, its log in <STACK_DIR>/logs):
  s3            moto's S3 server (the lake and MLflow's artifacts)
  mlflow        `mlflow server`: PostgreSQL backend store; artifacts *proxied* to s3://<bucket>/mlflow
                (clients need only the tracking URI, never S3 credentials for the registry)
  api-server, scheduler, dag-processor, triggerer   Airflow 3 on PostgreSQL
  worker-1, worker-2   Celery workers (CeleryExecutor, Redis at 127.0.0.1:6379 as the broker)
  serve         `python -m pipelines serve`: the scoring server, following the registry

`up` is idempotent: a component whose PID is alive is reported and left alone. The PostgreSQL
databases (<name>_airflow, <name>_mlflow), the bucket, the pool `ctr_registry`, the AWS connection
of the lake and MovieLens-100K in the lake are created when missing. DAGs are created unpaused, so
the documented chain (a validated day's Asset event starts retrain, cold start and monitor) runs.
Settings come from the environment (see `settings()`), so tests can run a second stack beside a
user's on other ports.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import boto3
import psycopg2
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))  # stack_procs beside this file, however it is loaded
import stack_procs as procs  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ORDER = ["s3", "mlflow", "api-server", "scheduler", "dag-processor", "triggerer", "worker-1", "worker-2", "serve"]
AIRFLOW = ORDER[2:-1]


def settings(environ=os.environ) -> dict:
    """Ports, names and paths of one stack; every value can be overridden by an environment variable."""
    g = lambda k, d: environ.get(k, d)  # noqa: E731
    name = g("STACK_NAME", "ctr_stack")
    return {
        "name": name,
        "dir": Path(g("STACK_DIR", str(REPO / ".stack"))),
        "pg": g("STACK_PG", "postgresql://postgres@127.0.0.1:5432"),
        "redis": g("STACK_REDIS_URL", "redis://127.0.0.1:6379/0"),
        "s3_port": int(g("STACK_S3_PORT", "9755")),
        "mlflow_port": int(g("STACK_MLFLOW_PORT", "5000")),
        "api_port": int(g("STACK_API_PORT", "8080")),
        "serve_port": int(g("STACK_SERVE_PORT", "8000")),
        # scheduler / triggerer / workers each serve their task logs on a port of their own
        "log_ports": [int(p) for p in g("STACK_LOG_PORTS", "8793,8794,8795,8796").split(",")],
        "bucket": g("STACK_BUCKET", "ctr-lake"),
        "worker_concurrency": int(g("STACK_WORKER_CONCURRENCY", "2")),
        "pipeline_config": g("CTR_PIPELINE_CONFIG", str(REPO / "configs" / "pipeline.yaml")),
        "load_movielens": g("STACK_LOAD_MOVIELENS", "1") == "1",
    }


def stack_env(s: dict, environ=os.environ) -> dict:
    """The environment every component (and a user's shell: `scripts/stack.py env`) runs with."""
    d, pg = s["dir"], s["pg"]
    s3 = f"http://127.0.0.1:{s['s3_port']}"
    env = {k: v for k, v in environ.items() if not k.startswith(("AIRFLOW__", "MLFLOW_"))}
    env.pop("CTR_MLFLOW_ARTIFACT_ROOT", None)  # the tracking server decides where artifacts go
    env.update(
        {
            "AIRFLOW_HOME": str(d / "airflow"),
            "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            # the documented chain runs as soon as the DAGs are parsed: the Asset event of a validated day starts
            # retrain, cold start and monitor (a DAG a user pauses stays paused: this acts at creation only)
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
            "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{s['api_port']}/execution/",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(d / "airflow" / "passwords.json"),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"{pg.replace('postgresql://', 'postgresql+psycopg2://')}/{s['name']}_airflow",
            "AIRFLOW__CELERY__BROKER_URL": s["redis"],
            "AIRFLOW__CELERY__RESULT_BACKEND": f"db+{pg}/{s['name']}_airflow",
            "AIRFLOW__CELERY__WORKER_CONCURRENCY": str(s["worker_concurrency"]),
            # workers import the task libraries once, before forking (see ctr_airflow/celery_config.py)
            "AIRFLOW__CELERY__CELERY_CONFIG_OPTIONS": "ctr_airflow.celery_config.CELERY_CONFIG",
            # every process signs and checks the same task-identity tokens
            "AIRFLOW__API_AUTH__JWT_SECRET": _secret(d, "jwt_secret"),
            "AIRFLOW__API__SECRET_KEY": _secret(d, "api_secret"),
            "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{s['api_port']}",
            "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(s["log_ports"][0]),
            "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(s["log_ports"][1]),
            "AIRFLOW__SCHEDULER__STANDALONE_DAG_PROCESSOR": "True",
            "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{s['mlflow_port']}",
            "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
            # no usage events from ad data, and no telemetry thread racing os.environ (pipelines/__init__.py)
            "MLFLOW_DISABLE_TELEMETRY": "true",
            # MLflow's records go to the root logger at their own level; left to MLflow they go to stderr,
            # which Airflow's task supervisor shows as ERROR whatever they were
            "MLFLOW_CONFIGURE_LOGGING": "false",
            # alias moves from any worker on any machine serialise on one advisory lock
            "CTR_REGISTRY_LOCK_URL": f"{pg}/{s['name']}_mlflow",
            "CTR_LAKE_AWS_CONN_ID": "ctr_lake",
            "CTR_PIPELINE_CONFIG": s["pipeline_config"],
            "AWS_ENDPOINT_URL": s3,
            "MLFLOW_S3_ENDPOINT_URL": s3,
            "AWS_ACCESS_KEY_ID": environ.get("AWS_ACCESS_KEY_ID", "stack"),
            "AWS_SECRET_ACCESS_KEY": environ.get("AWS_SECRET_ACCESS_KEY", "stack"),
            "AWS_DEFAULT_REGION": environ.get("AWS_DEFAULT_REGION", "us-east-1"),
            # the caller's own paths after ours: where a user's model family (`model.family: mypkg.ctr:Factory`)
            # lives when it is not installed; every worker and the DAG processor must import it (once each: a shell
            # that sourced `stack.py env` holds ours already)
            "PYTHONPATH": os.pathsep.join(
                dict.fromkeys(
                    [str(REPO / "plugins"), str(REPO), *filter(None, environ.get("PYTHONPATH", "").split(os.pathsep))]
                )
            ),
            "PATH": f"{BIN}{os.pathsep}{environ.get('PATH', '')}",
        }
    )
    return env


def _secret(d: Path, name: str) -> str:
    path = d / "secrets" / name
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(secrets.token_urlsafe(32))
    return path.read_text().strip()


def commands(s: dict) -> dict[str, list[str]]:
    a = str(BIN / "airflow")

    def worker(i: int) -> list[str]:
        return [a, "celery", "worker", "--celery-hostname", f"{s['name']}-worker-{i}@%h",
                "--concurrency", str(s["worker_concurrency"]), "--without-mingle", "--without-gossip"]  # fmt: skip

    return {
        "s3": [str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(s["s3_port"])],
        "mlflow": [
            str(BIN / "mlflow"),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(s["mlflow_port"]),
            "--workers",
            "1",
            "--backend-store-uri",
            f"{s['pg']}/{s['name']}_mlflow",
            "--artifacts-destination",
            f"s3://{s['bucket']}/mlflow",
            "--serve-artifacts",
        ],
        "api-server": [a, "api-server", "--host", "127.0.0.1", "--port", str(s["api_port"]), "--workers", "1"],
        "scheduler": [a, "scheduler"],
        "dag-processor": [a, "dag-processor"],
        "triggerer": [a, "triggerer"],
        "worker-1": worker(1),
        "worker-2": worker(2),
        # the scoring server, following the registry (it waits for the first ctr_base@champion)
        "serve": [
            str(BIN / "python"),
            "-m",
            "pipelines",
            "serve",
            "--config",
            s["pipeline_config"],
            "--host",
            "127.0.0.1",
            "--port",
            str(s["serve_port"]),
            "--poll-seconds",
            "5",
        ],
    }


def component_env(s: dict, env: dict, comp: str) -> dict:
    if comp.startswith("worker-"):
        i = int(comp.split("-")[1])
        return {**env, "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(s["log_ports"][1 + i])}
    return env


# --- processes (scripts/stack_procs.py) -------------------------------------------------------------


def pid_of(s: dict, comp: str) -> int | None:
    return procs.pid_of(s["dir"], comp)


def start(s: dict, env: dict, comp: str) -> str:
    return procs.start(s["dir"], comp, commands(s)[comp], component_env(s, env, comp), REPO)


def stop(s: dict, comp: str, grace_s: float = 20) -> str:
    return procs.stop(s["dir"], comp, grace_s)


# --- one-time set-up (each step idempotent) ------------------------------------------------------


def ensure_databases(s: dict) -> None:
    conn = psycopg2.connect(f"{s['pg']}/postgres", connect_timeout=5)
    conn.autocommit = True
    with conn.cursor() as cur:
        for db in (f"{s['name']}_airflow", f"{s['name']}_mlflow"):
            cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (db,))
            if cur.fetchone() is None:
                cur.execute(f'CREATE DATABASE "{db}"')
    conn.close()


def drop_databases(s: dict) -> None:
    conn = psycopg2.connect(f"{s['pg']}/postgres", connect_timeout=5)
    conn.autocommit = True
    with conn.cursor() as cur:
        for db in (f"{s['name']}_airflow", f"{s['name']}_mlflow"):
            cur.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
    conn.close()


def ensure_bucket(s: dict, env: dict) -> None:
    s3 = boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_DEFAULT_REGION"],
    )
    if s["bucket"] not in {b["Name"] for b in s3.list_buckets().get("Buckets", [])}:
        s3.create_bucket(Bucket=s["bucket"])


def airflow_cli(env: dict, *args: str, log=None) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(BIN / "airflow"), *args], env=env, cwd=REPO, capture_output=True, text=True)
    if log is not None:
        log.write(f"$ airflow {shlex.join(args)}\n{proc.stdout}{proc.stderr}\n")
    if proc.returncode != 0:
        raise SystemExit(f"airflow {' '.join(args)} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return proc


def init_airflow(s: dict, env: dict) -> None:
    """Schema, the registry pool, the lake's AWS connection, the admin password (kept across runs)."""
    pw_file = Path(env["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"])
    pw_file.parent.mkdir(parents=True, exist_ok=True)
    if not pw_file.exists():
        pw_file.write_text(json.dumps({"admin": secrets.token_urlsafe(12)}))
    with open(s["dir"] / "logs" / "init.log", "a") as log:
        airflow_cli(env, "db", "migrate", log=log)
        airflow_cli(env, "pools", "set", "ctr_registry", "1", "registry writes: registration and alias moves", log=log)
        extra = json.dumps({"endpoint_url": env["AWS_ENDPOINT_URL"], "region_name": env["AWS_DEFAULT_REGION"]})
        conns = airflow_cli(env, "connections", "list", "-o", "json", log=log).stdout
        if '"ctr_lake"' not in conns:
            airflow_cli(
                env,
                "connections",
                "add",
                "ctr_lake",
                "--conn-type",
                "aws",
                "--conn-login",
                env["AWS_ACCESS_KEY_ID"],
                "--conn-password",
                env["AWS_SECRET_ACCESS_KEY"],
                "--conn-extra",
                extra,
                log=log,
            )


def load_lake(s: dict, env: dict) -> str:
    """MovieLens-100K into the configured lake, unless its partitions are already there."""
    lake_uri = yaml.safe_load(Path(s["pipeline_config"]).read_text())["data"]["lake_uri"]
    check = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from pipelines.data.lake import Lake; "
            "sys.exit(0 if Lake(sys.argv[1]).list_partitions() else 1)",
            lake_uri,
        ],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if check.returncode == 0:
        return f"lake {lake_uri}: already loaded"
    with open(s["dir"] / "logs" / "generate.log", "a") as log:
        subprocess.run(
            [sys.executable, "-m", "pipelines", "generate", "--source", "movielens", "--out", lake_uri],
            env=env,
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            check=True,
        )
    return f"lake {lake_uri}: MovieLens-100K loaded"


# --- health ------------------------------------------------------------------------------------


def airflow_health(s: dict) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{s['api_port']}/api/v2/monitor/health", timeout=5) as r:
        return json.load(r)


def wait_healthy(s: dict, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    procs.wait_http(
        f"http://127.0.0.1:{s['api_port']}/api/v2/monitor/health",
        timeout_s,
        "api-server",
        lambda: pid_of(s, "api-server") is not None,
    )
    want = ("metadatabase", "scheduler", "triggerer", "dag_processor")
    while time.monotonic() < deadline:
        h = airflow_health(s)
        workers_ready = all(
            b"ready." in (s["dir"] / "logs" / f"{w}.log").read_bytes() for w in ("worker-1", "worker-2")
        )
        if all((h.get(k) or {}).get("status") == "healthy" for k in want) and workers_ready:
            return
        for comp in ORDER:
            if pid_of(s, comp) is None:
                raise SystemExit(f"{comp} exited; its log: {s['dir'] / 'logs' / (comp + '.log')}")
        time.sleep(1)
    raise SystemExit(f"stack not healthy within {timeout_s:.0f} s: {airflow_health(s)}")


# --- commands ----------------------------------------------------------------------------------


def up(s: dict) -> None:
    t0 = time.monotonic()
    (s["dir"] / "logs").mkdir(parents=True, exist_ok=True)
    env = stack_env(s)
    ensure_databases(s)
    for comp in ("s3", "mlflow"):
        print(start(s, env, comp), flush=True)
    procs.wait_http(f"http://127.0.0.1:{s['s3_port']}/moto-api/", 60, "moto S3 server")
    ensure_bucket(s, env)
    init_airflow(s, env)
    for comp in AIRFLOW:
        print(start(s, env, comp), flush=True)
    procs.wait_http(f"http://127.0.0.1:{s['mlflow_port']}/health", 120, "mlflow server", lambda: pid_of(s, "mlflow"))
    if s["load_movielens"]:
        print(load_lake(s, env), flush=True)
    print(start(s, env, "serve"), flush=True)  # after the lake: the config it reads names it
    wait_healthy(s)
    print(f"stack healthy in {time.monotonic() - t0:.0f} s")
    print_access(s, env)


def print_access(s: dict, env: dict) -> None:
    pw = json.loads(Path(env["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"]).read_text())["admin"]
    print(f"""
Airflow UI   http://127.0.0.1:{s["api_port"]}   user admin, password {pw}
             (stored in {env["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"]})
MLflow UI    {env["MLFLOW_TRACKING_URI"]}
Scoring      http://127.0.0.1:{s["serve_port"]}/invocations   (/healthz, /routes: what serves; it follows the
             registry, serving once ctr_base has a champion: trigger ctr_base_model)
S3 (moto)    {env["AWS_ENDPOINT_URL"]}   bucket {s["bucket"]}
Logs         {s["dir"] / "logs"}
This shell:  eval "$(.venv/bin/python scripts/stack.py env)"   then e.g.  airflow dags list, python -m pipelines status
Stop:        make stack-down""")


def down(s: dict, purge: bool = False) -> None:
    for comp in reversed(ORDER):
        print(stop(s, comp), flush=True)
    if purge:
        drop_databases(s)
        print(f"dropped databases {s['name']}_airflow and {s['name']}_mlflow")


def status(s: dict) -> int:
    running = 0
    for comp in ORDER:
        pid = pid_of(s, comp)
        running += pid is not None
        print(f"{comp:14s} {'running (pid %d)' % pid if pid else 'stopped'}")
    return 0 if running == len(ORDER) else 1


def main(argv: list[str]) -> int:
    s = settings()
    cmd = argv[0] if argv else "status"
    if cmd == "up":
        up(s)
    elif cmd == "down":
        down(s, purge="--purge" in argv)
    elif cmd == "env":
        env = stack_env(s)
        for k in sorted(env):
            if k.startswith(("AIRFLOW", "MLFLOW", "CTR_", "AWS_")) or k == "PYTHONPATH":
                print(f"export {k}={shlex.quote(env[k])}")
    elif cmd == "status":
        return status(s)
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
