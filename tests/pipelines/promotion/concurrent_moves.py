"""Run alias moves from many processes at once (the concurrency test's worker; real processes).

    python -m tests.pipelines.promotion.concurrent_moves TRACKING_URI MODEL PLAN_JSON [SYNC_DIR]

PLAN_JSON: a list of {"op": "promote"|"revert", "version": str|null, "op_id": str}. Every operation
runs in its own forked process; all start together (a barrier). With SYNC_DIR, several of these
commands (e.g. "machines" with different environments) start together too: once all of this
command's workers are at the barrier it writes SYNC_DIR/ready-<pid>, and they all wait for
SYNC_DIR/go. Prints one JSON line per operation, with the wall-clock span it took ("t0", "t1").
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import mlflow

from pipelines.errors import PipelineError
from pipelines.promotion import aliases


def _wait_for_go(sync_dir: str | None, first: bool) -> None:
    if sync_dir is None:
        return
    if first:
        (Path(sync_dir) / f"ready-{os.getppid()}").touch()
    deadline = time.monotonic() + 300
    while not (Path(sync_dir) / "go").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {sync_dir}/go within 300 s")
        time.sleep(0.01)


def _worker(uri: str, model: str, step: dict, barrier, out, sync_dir: str | None) -> None:
    mlflow.set_tracking_uri(uri)
    _wait_for_go(sync_dir, barrier.wait() == 0)
    t0 = time.time()
    try:
        if step["op"] == "promote":
            r = aliases.promote(
                model, step["version"], reason=f"concurrency {step['op_id']}", actor="test", op_id=step["op_id"]
            )
        else:
            r = aliases.revert(model, reason=f"concurrency {step['op_id']}", actor="test", op_id=step["op_id"])
        out.put({"op_id": step["op_id"], "moved": r["moved"], "to": r.get("to_version"), "t0": t0, "t1": time.time()})
    except PipelineError as exc:
        out.put({"op_id": step["op_id"], "refused": str(exc), "t0": t0, "t1": time.time()})
    except Exception as exc:  # anything else fails the test (with its message), rather than a silent hang
        out.put({"op_id": step["op_id"], "error": f"{type(exc).__name__}: {exc}", "t0": t0, "t1": time.time()})


def main(uri: str, model: str, plan: list[dict], sync_dir: str | None = None) -> list[dict]:
    # MLflow and aliases are imported (at module top) before forking, so children start fast; the parent
    # opens no store connection: a forked SQLAlchemy pool would share sockets between processes.
    ctx = mp.get_context("fork")
    barrier, out = ctx.Barrier(len(plan)), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(uri, model, s, barrier, out, sync_dir)) for s in plan]
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    return results


if __name__ == "__main__":
    for r in main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), *sys.argv[4:5]):
        print(json.dumps(r))
