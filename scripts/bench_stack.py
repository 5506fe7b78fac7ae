"""`make bench-stack`: the local stack measured (scripts/stack.py), results into docs/benchmarks.md.

    python scripts/bench_stack.py [--write docs/benchmarks.md]

1. start to healthy: `stack.py up` on fresh databases (cold), then again after `down` (warm);
2. one `ctr_lora_retrain` run on MovieLens (configs/pipeline.yaml, three slots) under the Celery stack,
   workers without and with the task-library preload (ctr_airflow/celery_config.py), after one
   unreported warm-up run, and under `airflow dags test` against the same tracking server: wall time
   of the run and per-task durations from Airflow's REST API (consecutive days, same window size);
3. what a task process pays to import its libraries in a fresh interpreter (the cost the preload removes).

Runs on ports of its own and drops its databases at the end; a user's `make stack` is not touched.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.conftest import free_port  # noqa: E402
from tests.e2e.airflow_rest import AirflowREST  # noqa: E402

BEGIN, END = "<!-- BEGIN bench stack -->", "<!-- END bench stack -->"
BASE_DAY, DAYS = "1997-12-31", ("1998-03-01", "1998-03-02", "1998-03-03", "1998-03-04")
LIBS = (
    "torch, pandas, pyarrow.parquet, sklearn.metrics, matplotlib.pyplot, mlflow, mlflow.pyfunc, peft, "
    "great_expectations"
)


def stack_cli(env: dict, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "stack.py"), *args], env=env, cwd=REPO, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(f"stack.py {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def timed_up(env: dict) -> float:
    t0 = time.perf_counter()
    stack_cli(env, "up")
    return time.perf_counter() - t0


def restart_workers(env: dict, preload: str | None) -> None:
    """Workers again, with (preload None: the default list) or without (preload "") the preload."""
    spec = importlib.util.spec_from_file_location("stack_script", REPO / "scripts" / "stack.py")
    stack = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stack)
    s = stack.settings(env)
    for w in ("worker-1", "worker-2"):
        stack.stop(s, w)
    wenv = {**env} if preload is None else {**env, "CTR_WORKER_PRELOAD": preload}
    for w in ("worker-1", "worker-2"):
        (s["dir"] / "logs" / f"{w}.log").unlink(missing_ok=True)
        stack.start(s, stack.stack_env(s, wenv), w)
    stack.wait_healthy(s)


def celery_run(rest: AirflowREST, day: str) -> dict:
    run_id = f"bench_{day}_{uuid.uuid4().hex[:4]}"
    rest.trigger("ctr_lora_retrain", run_id, day)
    run = rest.wait("ctr_lora_retrain", run_id, timeout_s=3600)
    assert run["state"] == "success", rest.task_instances("ctr_lora_retrain", run_id)
    tis = rest.task_instances("ctr_lora_retrain", run_id)
    per_task: dict[str, list[float]] = {}
    for t in tis:
        if t.get("duration") is not None:
            per_task.setdefault(t["task_id"], []).append(float(t["duration"]))
    wall = (dt.datetime.fromisoformat(run["end_date"]) - dt.datetime.fromisoformat(run["start_date"])).total_seconds()
    return {
        "wall_s": wall,
        "tasks": {k: statistics.median(v) for k, v in per_task.items()},
        "task_s_total": sum(sum(v) for v in per_task.values()),
        "task_count": sum(len(v) for v in per_task.values()),
    }


def dags_test_run(env: dict, day: str, home: Path) -> float:
    """`airflow dags test` on an Airflow database of its own (SQLite): sharing the stack's with a
    running scheduler would let the scheduler hand the run's tasks to the Celery workers (and the
    two schedulers deadlock on its rows). MLflow, S3 and the lock are the stack's."""
    airflow = str(Path(sys.executable).with_name("airflow"))
    env = {k: v for k, v in env.items() if k != "CTR_LAKE_AWS_CONN_ID"}  # that connection is in the stack's DB
    env = {
        **env,
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db",
    }
    home.mkdir(parents=True, exist_ok=True)
    for args in (["db", "migrate"], ["pools", "set", "ctr_registry", "1", "registry writes"]):
        subprocess.run([airflow, *args], env=env, cwd=REPO, capture_output=True, check=True)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [airflow, "dags", "test", "ctr_lora_retrain", day], env=env, cwd=REPO, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(f"airflow dags test failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return time.perf_counter() - t0


def fresh_import_s(env: dict) -> float:
    """Seconds a task process spends importing the task libraries when nothing is preloaded."""
    code = f"import time; t = time.perf_counter(); import {LIBS}; print(time.perf_counter() - t)"
    return float(
        subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.strip()
    )


def forked_import_s(env: dict) -> float:
    """The same in a process forked from a parent that preloaded them (what a preloading worker's task
    process does; Airflow's supervisor forks on Linux)."""
    code = (
        f"import os, sys, time; import {LIBS}\n"
        "r, w = os.pipe()\n"
        "if os.fork() == 0:\n"
        f"    t = time.perf_counter(); import {LIBS}; os.write(w, str(time.perf_counter() - t).encode()); os._exit(0)\n"
        "os.wait(); print(os.read(r, 64).decode())"
    )
    return float(
        subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.strip()
    )


def measure() -> dict:
    name = f"ctr_bench_{uuid.uuid4().hex[:6]}"
    env = {
        **os.environ,
        "STACK_NAME": name,
        "STACK_DIR": f"/tmp/{name}",
        "STACK_BUCKET": "ctr-lake",
        "STACK_S3_PORT": str(free_port()),
        "STACK_MLFLOW_PORT": str(free_port()),
        "STACK_API_PORT": str(free_port()),
        "STACK_LOG_PORTS": ",".join(str(free_port()) for _ in range(4)),
        "STACK_REDIS_URL": "redis://127.0.0.1:6379/14",
    }
    out: dict = {}
    try:
        out["up_cold_s"] = timed_up(env)
        stack_cli(env, "down")
        out["up_warm_s"] = timed_up(env)
        svc = {k: shlex.split(v)[0] for k, v in re.findall(r"^export (\w+)=(.*)$", stack_cli(env, "env"), flags=re.M)}
        rest = AirflowREST(
            f"http://127.0.0.1:{env['STACK_API_PORT']}",
            "admin",
            json.loads(Path(env["STACK_DIR"], "airflow", "passwords.json").read_text())["admin"],
        )
        for dag_id in ("ctr_base_model", "ctr_lora_retrain"):
            rest.unpause(dag_id)
        rest.trigger("ctr_base_model", "bench_base", BASE_DAY)
        assert rest.wait("ctr_base_model", "bench_base", timeout_s=3600)["state"] == "success"
        celery_run(rest, DAYS[0])  # warm-up, not reported: the first run validates the whole window
        restart_workers(env, "")
        out["celery_no_preload"] = celery_run(rest, DAYS[1])
        restart_workers(env, None)
        out["celery_preload"] = celery_run(rest, DAYS[2])
        print(json.dumps(out), flush=True)  # what is measured so far, in case a later step fails
        out["dags_test_s"] = dags_test_run({**env, **svc}, DAYS[3], Path(env["STACK_DIR"]) / "dags-test")
        out["fresh_import_s"] = fresh_import_s({**env, **svc})
        out["forked_import_s"] = forked_import_s({**env, **svc})
    finally:
        stack_cli(env, "down", "--purge")
    return out


def render(r: dict, command: str) -> str:
    pre, nopre = r["celery_preload"], r["celery_no_preload"]
    rows = "\n".join(f"| `{t}` | {nopre['tasks'].get(t, 0):.1f} | {pre['tasks'][t]:.1f} |" for t in pre["tasks"])
    return f"""{BEGIN}
Generated by `{command}` on {dt.date.today()} ({platform.machine()}, {os.cpu_count()} cores, Python
{platform.python_version()}); single runs, wall-clock seconds.

| what | result | goal |
|---|---|---|
| `make stack` start to healthy, fresh databases (migrations, pool, connection; MovieLens load included) | {r["up_cold_s"]:.0f} s | ≤ 90 s |
| the same after `make stack-down` (databases kept) | {r["up_warm_s"]:.0f} s | |
| one `ctr_lora_retrain` run (3 slots, MovieLens), Celery stack, workers preloading the task libraries | {pre["wall_s"]:.0f} s wall, {pre["task_s_total"]:.0f} s summed over {pre["task_count"]} task instances | |
| the same run, workers without the preload (what every task paid before) | {nopre["wall_s"]:.0f} s wall, {nopre["task_s_total"]:.0f} s summed | |
| the same run under `airflow dags test` (one process, same tracking server) | {r["dags_test_s"]:.0f} s | |
| per-task start-up overhead, imports: a task process importing the task libraries ({LIBS}) | {r["fresh_import_s"]:.1f} s without the preload, {r["forked_import_s"]:.3f} s forked from a preloading worker | halve it |

Median task duration (s) by task, without / with the preload:

| task | without preload | with preload |
|---|---|---|
{rows}
{END}"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", help="replace the generated section of this markdown file")
    a = ap.parse_args(argv)
    r = measure()
    print(json.dumps(r, indent=1))
    text = render(r, "make bench-stack")
    print(text)
    if a.write:
        doc = Path(a.write).read_text()
        if BEGIN in doc:
            doc = doc[: doc.index(BEGIN)] + text + doc[doc.index(END) + len(END) :]
        else:
            doc = doc.rstrip() + "\n\n## Local stack (`make bench-stack`)\n\n" + text + "\n"
        Path(a.write).write_text(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
