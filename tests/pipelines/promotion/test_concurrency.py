"""The registry lock (`pipelines.registry.lock`) makes alias moves atomic across processes and machines.

20 concurrent promote/revert operations on one model, from real processes split over two "machines"
(each its own TMPDIR and CTR_LOCK_DIR, so nothing machine-local can serialise them): the alias ends
on the last recorded move, the history is one unbroken chain with no lost or duplicated entries, and
re-running an operation adds nothing. Against the production-like store opened directly (PostgreSQL
when reachable, required in CI; else SQLite: its own lock), and against a real `mlflow server` over
HTTP with CTR_REGISTRY_LOCK_URL on PostgreSQL or Redis. Over HTTP without a lock URL, and with a lock
backend that is unknown or unreachable, every move is refused and nothing moves.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import mlflow
import pytest
import redis
from mlflow import MlflowClient

from pipelines.errors import PromotionError
from pipelines.promotion import aliases
from pipelines.registry import lock
from tests.conftest import REDIS_URL, adapter_tags, free_port, redis_available, use_mlflow_server

REPO = Path(__file__).resolve().parents[3]
MODEL = "ctr_lora_feed"


def run_machines(uri: str, model: str, plans: list[list[dict]], tmp: Path) -> list[dict]:
    """Run each plan with concurrent_moves on its own "machine" (TMPDIR, CTR_LOCK_DIR), all plans'
    operations starting together; returns every operation's result, tagged with its machine."""
    sync = tmp / f"sync-{uuid.uuid4().hex[:8]}"
    sync.mkdir()
    procs, logs = [], []
    for i, plan in enumerate(plans):
        machine = tmp / f"machine-{i}"
        machine.mkdir(exist_ok=True)
        env = {**os.environ, "CTR_TORCH_THREADS": "1", "TMPDIR": str(machine), "CTR_LOCK_DIR": str(machine)}
        out, err = open(sync / f"out-{i}", "w+"), open(sync / f"err-{i}", "w+")  # no pipe to fill up
        logs.append((out, err))
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.pipelines.promotion.concurrent_moves",
                    uri,
                    model,
                    json.dumps(plan),
                    str(sync),
                ],
                cwd=REPO,
                env=env,
                stdout=out,
                stderr=err,
                text=True,
            )
        )
    deadline = time.monotonic() + 300
    while len(list(sync.glob("ready-*"))) < len(plans):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "a machine did not get ready"
        time.sleep(0.05)
    (sync / "go").touch()
    results = []
    for i, (p, (out, err)) in enumerate(zip(procs, logs)):
        assert p.wait(timeout=600) == 0, (sync / f"err-{i}").read_text()[-3000:]
        results += [
            {**json.loads(line), "machine": i}
            for line in (sync / f"out-{i}").read_text().splitlines()
            if line.startswith("{")
        ]
        out.close()
        err.close()
    return results


@pytest.fixture(params=["store", "http+postgresql-lock", "http+redis-lock"])
def registry(request, store_uri, tmp_path, monkeypatch):
    """(tracking URI, model name) with this process on it and CTR_REGISTRY_LOCK_URL set for its kind.

    "store": the fresh store opened directly, no lock URL (the tracking database's own lock).
    "http+…": the session's mlflow server, a model name of its own (the server is shared), and the
    lock on store_uri's fresh PostgreSQL database (another database than the server's) or on Redis."""
    if request.param == "store":
        monkeypatch.chdir(tmp_path)
        monkeypatch.delenv(lock.LOCK_URL_ENV, raising=False)
        mlflow.set_tracking_uri(store_uri)
        yield store_uri, MODEL
        return
    lock_url = store_uri if request.param == "http+postgresql-lock" else REDIS_URL
    if not lock_url.startswith("postgresql") and not (lock_url == REDIS_URL and redis_available()):
        pytest.skip(f"{request.param}: no PostgreSQL / Redis reachable for the lock")
    server = request.getfixturevalue("mlflow_server")
    use_mlflow_server(server, tmp_path, monkeypatch)
    monkeypatch.setenv(lock.LOCK_URL_ENV, lock_url)
    yield server.uri, f"ctr_lora_conc_{uuid.uuid4().hex[:8]}"
    mlflow.set_tracking_uri(None)


@pytest.mark.slow
def test_twenty_concurrent_moves_leave_one_consistent_history(registry, tmp_path):
    uri, model = registry
    c = MlflowClient()
    c.create_registered_model(model)
    for _ in range(5):  # a tracking server only takes remote sources without a run; never read here
        c.create_model_version(
            model, source="s3://ctr-test/never-read", tags=adapter_tags(f"{model}_base", **{"gate.passed": "true"})
        )
    aliases.promote(model, "1", reason="initial champion", actor="test", op_id="init")

    rng = random.Random(5)
    plan = [
        {"op": "revert", "version": None, "op_id": f"op-{i}"}
        if i % 3 == 2
        else {"op": "promote", "version": str(rng.randint(1, 5)), "op_id": f"op-{i}"}
        for i in range(20)
    ]
    results = run_machines(uri, model, [plan[0::2], plan[1::2]], tmp_path)
    assert sorted(r["op_id"] for r in results) == sorted(p["op_id"] for p in plan)  # every process answered
    assert [r for r in results if "error" in r] == []
    spans = [
        (min(r["t0"] for r in results if r["machine"] == m), max(r["t1"] for r in results if r["machine"] == m))
        for m in (0, 1)
    ]
    assert max(s[0] for s in spans) < min(s[1] for s in spans)  # the two machines really overlapped

    hist = aliases.history(model)
    moved = {r["op_id"] for r in results if r.get("moved")}
    recorded = [e["op_id"] for e in hist]
    assert len(recorded) == len(set(recorded))  # no duplicated entry
    assert set(recorded) == moved | {"init"}  # no lost entry, nothing unrequested
    assert aliases.current(model) == hist[-1]["to_version"]  # the alias is the last recorded move
    for before, after in zip(hist, hist[1:]):  # one chain: each move starts where the last ended
        assert after["from_version"] == before["to_version"] and int(after["seq"]) > int(before["seq"])
    refused = [r for r in results if "refused" in r]
    assert all("no earlier champion" in r["refused"] for r in refused)
    assert len(moved) >= 5  # (a promote to the serving version is a no-op)

    again = run_machines(uri, model, [[p for p in plan if p["op_id"] in moved][:5]], tmp_path)  # re-run five
    assert len(again) == 5 and all(r["moved"] is False for r in again)
    assert aliases.history(model) == hist and aliases.current(model) == hist[-1]["to_version"]


@pytest.mark.slow
def test_over_http_without_a_lock_url_every_move_is_refused_and_nothing_moves(on_mlflow_server, monkeypatch):
    model = f"ctr_lora_nolock_{uuid.uuid4().hex[:8]}"
    c = MlflowClient()
    c.create_registered_model(model)
    for _ in range(2):
        c.create_model_version(
            model, source="s3://ctr-test/never-read", tags=adapter_tags(f"{model}_base", **{"gate.passed": "true"})
        )
    aliases.promote(model, "1", reason="with the lock", actor="test")  # the server's lock URL: allowed
    monkeypatch.delenv(lock.LOCK_URL_ENV)
    for move in (
        lambda: aliases.promote(model, "2", reason="no lock", actor="test"),
        lambda: aliases.revert(model, reason="no lock", to_version="2", actor="test"),
        lambda: aliases.start_canary(model, "2", 0.1, reason="no lock", actor="test"),
        lambda: aliases.move_alias(model, "champion", None, kind="withdraw", reason="no lock", actor="t"),
    ):
        with pytest.raises(PromotionError, match=f"set {lock.LOCK_URL_ENV} to postgresql://"):
            move()
    assert aliases.current(model) == "1" and aliases.current(model, "canary") is None
    assert [e["reason"] for e in aliases.history(model, None)] == ["with the lock"]
    assert "canary.share" not in c.get_model_version(model, "2").tags  # not even the share


@pytest.mark.parametrize(
    "url, message",
    [
        ("mysql://ops:s3cret@db.internal/locks", "unknown scheme 'mysql'"),
        ("file:///tmp/locks", "unknown scheme 'file'"),
        (f"redis://127.0.0.1:{free_port()}/0", "cannot reach the registry lock at redis://127.0.0.1"),
        (f"postgresql://postgres:s3cret@127.0.0.1:{free_port()}/x", "cannot reach the registry lock database"),
    ],
    ids=["unknown-scheme", "file-scheme", "redis-unreachable", "postgresql-unreachable"],
)
def test_an_unknown_or_unreachable_lock_url_refuses_the_move(tracking, monkeypatch, url, message):
    c = MlflowClient()
    c.create_registered_model(MODEL)
    c.create_model_version(MODEL, source="file:///tmp/x", tags=adapter_tags(**{"gate.passed": "true"}))
    monkeypatch.setenv(lock.LOCK_URL_ENV, url)  # set, it wins over the SQLite store's own file lock
    with pytest.raises(PromotionError, match=message) as err:
        aliases.promote(MODEL, "1", reason="r", actor="test")
    assert "s3cret" not in str(err.value)  # no password in task logs
    assert aliases.current(MODEL) is None and aliases.history(MODEL, None) == []


@pytest.fixture
def redis_lock_url(monkeypatch):
    if not redis_available():
        pytest.skip("Redis at 127.0.0.1:6379 is not reachable")
    monkeypatch.setenv(lock.LOCK_URL_ENV, REDIS_URL)
    return REDIS_URL


def test_a_redis_lock_is_renewed_while_held_and_released_after(redis_lock_url, monkeypatch):
    monkeypatch.setattr(lock, "REDIS_TTL_S", 0.6)  # a short lease, to outlive it in the test
    name, client = f"renew-{uuid.uuid4().hex[:8]}", redis.Redis.from_url(redis_lock_url)
    key = f"{lock.REDIS_KEY_PREFIX}{name}"
    other = []
    with lock.registry_lock(name):
        time.sleep(2.0)  # > 3 TTLs: only renewal keeps it
        assert client.exists(key)
        contender = threading.Thread(target=lambda: other.append(_try_lock(name)))  # not re-entrant there
        contender.start()
        contender.join()
        assert other == [False]  # another holder is kept out
    assert not client.exists(key)  # released on exit, not left to expire
    assert _try_lock(name)


def _try_lock(name: str) -> bool:
    try:
        with lock.registry_lock(name, timeout_s=0.2):
            return True
    except PromotionError:
        return False


def test_a_redis_lock_lost_while_held_fails_the_block(redis_lock_url):
    name = f"lost-{uuid.uuid4().hex[:8]}"
    with pytest.raises(PromotionError, match="was lost while held"):
        with lock.registry_lock(name):
            redis.Redis.from_url(redis_lock_url).delete(f"{lock.REDIS_KEY_PREFIX}{name}")  # as if it expired
