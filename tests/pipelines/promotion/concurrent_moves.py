"""Run alias moves from many processes at once (the concurrency test's worker; real processes).

    python -m tests.pipelines.promotion.concurrent_moves TRACKING_URI MODEL PLAN_JSON

PLAN_JSON: a list of {"op": "promote"|"revert", "version": str|null, "op_id": str}. Every operation
runs in its own forked process; all start together (a barrier). Prints one JSON line per operation.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import sys


def _worker(uri: str, model: str, step: dict, barrier, out) -> None:
    import mlflow

    from pipelines.errors import PipelineError
    from pipelines.promotion import aliases

    mlflow.set_tracking_uri(uri)
    barrier.wait()
    try:
        if step["op"] == "promote":
            r = aliases.promote(model, step["version"], reason=f"concurrency {step['op_id']}", actor="test",
                                op_id=step["op_id"])
        else:
            r = aliases.revert(model, reason=f"concurrency {step['op_id']}", actor="test", op_id=step["op_id"])
        out.put({"op_id": step["op_id"], "moved": r["moved"], "to": r.get("to_version")})
    except PipelineError as exc:
        out.put({"op_id": step["op_id"], "refused": str(exc)})


def main(uri: str, model: str, plan: list[dict]) -> list[dict]:
    # Import before forking so children start fast, but open no store connection in the parent:
    # a forked SQLAlchemy pool would share sockets between processes.
    import mlflow  # noqa: F401

    import pipelines.promotion.aliases  # noqa: F401

    ctx = mp.get_context("fork")
    barrier, out = ctx.Barrier(len(plan)), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(uri, model, s, barrier, out)) for s in plan]
    for p in procs:
        p.start()
    results = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    return results


if __name__ == "__main__":
    for r in main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3])):
        print(json.dumps(r))
