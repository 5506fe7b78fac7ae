"""20 concurrent promote/revert operations on one model, from real processes, on the production-like
store (PostgreSQL when reachable, required in CI; else SQLite): the alias ends on the last recorded
move, the history is one unbroken chain with no lost or duplicated entries, and re-running an
operation adds nothing."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient

from pipelines.promotion import aliases

REPO = Path(__file__).resolve().parents[3]
MODEL = "ctr_lora_feed"


def run_plan(uri: str, plan: list[dict]) -> list[dict]:
    proc = subprocess.run([sys.executable, "-m", "tests.pipelines.promotion.concurrent_moves", uri, MODEL,
                           json.dumps(plan)], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "CTR_TORCH_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_twenty_concurrent_moves_leave_one_consistent_history(store_uri, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    mlflow.set_tracking_uri(store_uri)
    c = MlflowClient()
    c.create_registered_model(MODEL)
    for _ in range(5):
        c.create_model_version(MODEL, source="file:///tmp/x", tags={"gate.passed": "true"})
    aliases.promote(MODEL, "1", reason="initial champion", actor="test", op_id="init")

    rng = random.Random(5)
    plan = [{"op": "revert", "version": None, "op_id": f"op-{i}"} if i % 3 == 2 else
            {"op": "promote", "version": str(rng.randint(1, 5)), "op_id": f"op-{i}"} for i in range(20)]
    results = run_plan(store_uri, plan)
    assert sorted(r["op_id"] for r in results) == sorted(p["op_id"] for p in plan)   # every process answered

    hist = aliases.history(MODEL)
    moved = {r["op_id"] for r in results if r.get("moved")}
    recorded = [e["op_id"] for e in hist]
    assert len(recorded) == len(set(recorded))                       # no duplicated entry
    assert set(recorded) == moved | {"init"}                         # no lost entry, nothing unrequested
    assert aliases.current(MODEL) == hist[-1]["to_version"]          # the alias is the last recorded move
    for before, after in zip(hist, hist[1:]):                        # one chain: each move starts where the last ended
        assert after["from_version"] == before["to_version"] and int(after["seq"]) > int(before["seq"])
    refused = [r for r in results if "refused" in r]
    assert all("no earlier champion" in r["refused"] for r in refused)
    assert len(moved) >= 5                                           # (a promote to the serving version is a no-op)

    again = run_plan(store_uri, [p for p in plan if p["op_id"] in moved][:5])   # re-run five tasks
    assert all(r["moved"] is False for r in again)
    assert aliases.history(MODEL) == hist and aliases.current(MODEL) == hist[-1]["to_version"]
