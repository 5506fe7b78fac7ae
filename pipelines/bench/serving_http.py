"""Serving over HTTP, measured from outside: `python -m pipelines serve` under concurrent load.

Set-up (all under a temporary directory): a real `mlflow server` (SQLite backend, proxied artifacts,
webhooks allowed to call loopback over HTTP); the registry of `pipelines.bench.serving` (untrained
base of the default ModelConfig, r=8 q/v adapters with random weights, 3 slots) plus a second feed
version, a second base and three adapters trained on it; `python -m pipelines serve` as its own process
with the alias webhook registered (polling every 600 s, so what it sees in time came by webhook).
The serving process runs on the upper half of the machine's cores, this process and the MLflow server
on the lower half (`CORES`; a deployment does not share the server's cores with its clients).
Clients are threads of this process, each on its own keep-alive connection, on loopback, each sending
the next request when the last one is answered (a bounded, self-stopping loop); the bodies are MLflow
`dataframe_split` JSON serialised once. On a 2-core machine that is one core each.

Figures (keys of `run()`):

* ``rps_b1`` / ``p50_ms_b1`` / ``p99_ms_b1`` and ``_b32``: answered requests per second and client-side
  latency percentiles with ``CLIENTS`` clients at batch 1 and 32 rows, no alias moving.
* ``promote_visible_ms``: median time from the alias move's registry call (`feed@champion` to the other
  version: the move a promote_canary or a revert makes) to the first response a probe client gets that
  was scored by the new version, while the batch-32 load runs (webhook path).
* ``promote_routes_ms``: the same moves, to the moment `/routes` (polled every 10 ms, outside the scoring
  queue) first shows the new version: the follow-and-swap part of promote_visible_ms, without the probe
  request's own wait behind the load.
* ``p99_during_swaps_ratio``: batch-32 p99 while ``moves`` such moves happen, one after the other as
  each becomes visible, over the batch-32 p99 without moves.
* ``base_switch_ms``: a new `ctr_base@champion` and then its three adapter champions; from the last
  alias move to the first response in which every slot is scored by the new base's adapter, under load.
* ``promote_visible_ms_poll``: as promote_visible_ms, with no webhook and `--poll-seconds 1` (so about
  half the interval plus a refresh; it names the fallback's delay, not a goal).
* ``failed_requests``: responses other than 200 (or a broken connection) in every phase above.
* ``misrouted_requests``: responses in which a slot was scored by a version the routing table did not
  name when the request began or ended (`RouteWatcher` keeps every table `/routes` showed), or in which
  the slots' versions match no single table (a mix of bases or of tables), or a slot got two versions
  (names only; tests/pipelines/serving/test_http_base_change.py also checks every score against the
  named version's pyfunc).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import mlflow
import torch

from pipelines.bench import serving_demo as demo
from pipelines.bench.serving_procs import CORES, SECRET, free_port, get_json, mlflow_server, request_frame, serving
from pipelines.config import ModelConfig
from pipelines.model.base import CTRModel
from pipelines.registry import mlflow_io
from pipelines.registry.mlflow_scope import temporary_mlflow
from pipelines.serving.cli import register_webhook

CLIENTS = 8


class Client:
    """One keep-alive connection; `post` returns (status, decoded body or None, start, end)."""

    def __init__(self, url: str):
        host, port = url.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=30)

    def post(self, body: bytes) -> tuple[int, dict | None, float, float]:
        start = time.perf_counter()
        try:
            self.conn.request("POST", "/invocations", body, {"Content-Type": "application/json"})
            r = self.conn.getresponse()
            data = r.read()
        except (OSError, http.client.HTTPException):
            self.conn.close()
            return 0, None, start, time.perf_counter()
        end = time.perf_counter()
        return r.status, (json.loads(data) if r.status == 200 else None), start, end


class RouteWatcher:
    """Polls `/routes` and keeps every distinct table seen, with the times it was seen."""

    def __init__(self, url: str, every_s: float = 0.01):
        self.url, self.every_s = url, every_s
        self.seen: list[tuple[float, dict]] = []  # (time, routes) at each change (and the first)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> RouteWatcher:
        self._observe()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def _observe(self) -> dict:
        routes = get_json(self.url, "/routes")[1]["routes"]
        if not self.seen or self.seen[-1][1] != routes:
            self.seen.append((time.perf_counter(), routes))
        return routes

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            with contextlib.suppress(OSError, http.client.HTTPException):
                self._observe()

    def wait_for(self, ok: Callable[[dict], bool], timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while not (self.seen and ok(self.seen[-1][1])):
            if time.monotonic() > deadline:
                raise RuntimeError(f"/routes never showed the expected table; last: {self.seen[-1][1]}")
            time.sleep(0.005)

    def tables(self, start: float, end: float) -> list[dict]:
        """The tables that may have served a request sent at `start` and answered at `end`: the one seen
        last before it began, every one seen while it ran, and the first one seen after it ended."""
        before = [r for t, r in self.seen if t <= start][-1:]
        during = [r for t, r in self.seen if start < t <= end]
        after = [r for t, r in self.seen if t > end][:1]
        return before + during + after


def misrouted(record: tuple, slots: list[str], watcher: RouteWatcher, prefix: str = "ctr_lora_") -> bool:
    """True when the response's versions match none of the tables that may have served it."""
    _, out, start, end = record
    by_slot: dict[str, set[str]] = {}
    for slot, served in zip(slots, out["served_by"]):
        by_slot.setdefault(slot, set()).add(f"{served['model']}:{served['version']}")
    if any(len(v) != 1 for v in by_slot.values()):
        return True
    got = {s: next(iter(v)) for s, v in by_slot.items()}
    return not any(all(t.get(f"{prefix}{s}@champion") == k for s, k in got.items()) for t in watcher.tables(start, end))


def load(
    url: str, body: bytes, *, seconds: float | None = None, until: threading.Event | None = None, clients: int = CLIENTS
) -> list[tuple]:
    """Every (status, out, start, end) of `clients` threads sending `body` back to back, for `seconds`
    or until `until` is set."""
    records: list[tuple] = []
    stop = until or threading.Event()

    def client() -> None:
        c = Client(url)
        while not stop.is_set():
            records.append(c.post(body))

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    if seconds is not None:
        time.sleep(seconds)
        stop.set()
    for t in threads:
        t.join()
    return records


def percentiles(records: list[tuple]) -> dict[str, float]:
    """rps and p50 / p99 ms of the answered requests (first and last answer bound the wall time)."""
    ok = [(s, e) for status, _, s, e in records if status == 200]
    wall = max(e for _, e in ok) - min(s for s, _ in ok)
    ms = sorted(1000 * (e - s) for s, e in ok)
    q = statistics.quantiles(ms, n=100, method="inclusive")
    return {"rps": len(ok) / wall, "p50_ms": q[49], "p99_ms": q[98]}


def visible_ms(client: Client, body: bytes, move: Callable[[], None], done: Callable[[dict], bool]) -> float:
    """ms from calling `move()` to the first response of `client` (sending `body`) that `done` accepts."""
    start = time.perf_counter()
    move()
    while True:
        status, out, _, end = client.post(body)
        if status == 200 and done(out):
            return 1000 * (end - start)
        if end - start > 120:
            raise RuntimeError("the move never became visible within 120 s")


# ----------------------------------------------------------------------------- the run


def _populate(frame) -> dict:
    """Base 1 with the 3 slot champions and a second feed version; base 2 (not champion yet) with two
    feed versions and one of each other slot. Returns the version numbers."""
    experiment = mlflow.create_experiment("bench-serving-http")
    example = mlflow_io.input_example(frame)
    out: dict = {}
    for b, alias in ((1, "champion"), (2, None)):
        torch.manual_seed(b)
        model = CTRModel(ModelConfig()).eval()
        base = demo.register_base(model, example, alias=alias, experiment_id=experiment)
        out[f"base{b}"] = base.version
        for i, slot in enumerate(("feed", "feed", "search", "splash")):
            logged = demo.log_adapter(
                demo.random_adapter(model, seed=100 * b + i), slot, base, example, experiment_id=experiment
            )
            first = f"b{b}_{slot}" not in out
            v = demo.register_adapter(
                logged, f"ctr_lora_{slot}", slot, base=base, alias="champion" if alias and first else None
            )
            out[f"b{b}_{slot}" if first else f"b{b}_{slot}_alt"] = v
    return out


def _body(frame) -> bytes:
    return json.dumps(
        {"dataframe_split": json.loads(frame.to_json(orient="split", index=False, date_format="iso"))}
    ).encode()


def _under_load(url: str, body: bytes, work: Callable[[], object]) -> tuple[list[tuple], object]:
    """(load records, work()) with the CLIENTS-thread load running for as long as `work` takes."""
    stop, box = threading.Event(), {}
    loader = threading.Thread(target=lambda: box.setdefault("r", load(url, body, until=stop)))
    loader.start()
    try:
        result = work()
    finally:
        stop.set()
        loader.join()
    return box["r"], result


def run(quick: bool) -> dict:
    """Every figure of the module docstring (a dict of floats and ints)."""
    moves, steady_s, polls = (20, 3.0, 3) if quick else (100, 10.0, 10)
    saved_affinity = os.sched_getaffinity(0) if CORES["others"] else None
    if saved_affinity:
        os.sched_setaffinity(0, CORES["others"])  # this process's client threads stay off the server's cores
    try:
        return _run(moves, steady_s, polls)
    finally:
        if saved_affinity:
            os.sched_setaffinity(0, saved_affinity)


def _run(moves: int, steady_s: float, polls: int) -> dict:
    frame = request_frame(2000)
    b32, b1 = frame.sample(32, random_state=1), frame.sample(1, random_state=2)
    one_each = frame.groupby("slot").head(1)
    feed_row = frame[frame["slot"] == "feed"].head(1)
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp, mlflow_server(Path(tmp)) as tracking, temporary_mlflow(tracking):
        root, client = Path(tmp), mlflow.MlflowClient()
        v = _populate(frame)
        port = free_port()
        register_webhook(f"http://127.0.0.1:{port}/webhooks/mlflow", SECRET)
        with serving(root, tracking, port=port, poll_seconds=600, webhook=True) as url, RouteWatcher(url) as watcher:
            records = {"b1": load(url, _body(b1), seconds=steady_s), "b32": load(url, _body(b32), seconds=steady_s)}
            for size in ("b1", "b32"):
                out.update({f"{k}_{size}": x for k, x in percentiles(records[size]).items()})

            def promote_revert() -> tuple[list[float], list[float]]:
                probe, times, seen, box = Client(url), [], [], {}
                for i in range(moves):
                    target = v["b1_feed_alt"] if i % 2 == 0 else v["b1_feed"]

                    def move() -> None:
                        box["start"] = time.perf_counter()
                        client.set_registered_model_alias("ctr_lora_feed", "champion", target)

                    times.append(
                        visible_ms(probe, _body(feed_row), move, lambda o: o["served_by"][0]["version"] == target)
                    )
                    watcher.wait_for(lambda r: r["ctr_lora_feed@champion"] == f"ctr_lora_feed:{target}")
                    seen.append(1000 * (watcher.seen[-1][0] - box["start"]))
                return times, seen

            records["swaps"], (times, seen) = _under_load(url, _body(b32), promote_revert)
            out["promote_visible_ms"] = statistics.median(times)
            out["promote_routes_ms"] = statistics.median(seen)
            out["p99_during_swaps_ratio"] = percentiles(records["swaps"])["p99_ms"] / out["p99_ms_b32"]
            records["base"], out["base_switch_ms"] = _under_load(
                url, _body(b32), lambda: _base_switch(url, client, v, _body(one_each))
            )
            watcher.wait_for(lambda r: r["ctr_lora_splash@champion"] == f"ctr_lora_splash:{v['b2_splash']}")
        slots = {"b1": b1["slot"].tolist(), "b32": b32["slot"].tolist()}
        checked = [(r, slots["b1" if k == "b1" else "b32"]) for k, rs in records.items() for r in rs]
        out["failed_requests"] = sum(r[0] != 200 for r, _ in checked)
        out["misrouted_requests"] = sum(misrouted(r, s, watcher) for r, s in checked if r[0] == 200)
        out["requests_checked"] = len(checked)
        with serving(root, tracking, port=free_port(), poll_seconds=1.0, webhook=False) as url:
            probe, times = Client(url), []
            for i in range(polls):
                target = v["b2_feed_alt"] if i % 2 == 0 else v["b2_feed"]
                times.append(
                    visible_ms(
                        probe,
                        _body(feed_row),
                        lambda: client.set_registered_model_alias("ctr_lora_feed", "champion", target),
                        lambda o: o["served_by"][0]["version"] == target,
                    )
                )
            out["promote_visible_ms_poll"] = statistics.median(times)
    out["moves"] = moves
    return out


def _base_switch(url: str, client, v: dict, body: bytes) -> float:
    """Move ctr_base@champion to base 2 and the feed and search champions onto it, wait until the
    server has loaded them (pending, waiting for splash only), then time the last move."""
    client.set_registered_model_alias("ctr_base", "champion", v["base2"])
    for slot in ("feed", "search"):
        client.set_registered_model_alias(f"ctr_lora_{slot}", "champion", v[f"b2_{slot}"])
    deadline = time.monotonic() + 120
    while True:
        routes = get_json(url, "/routes")[1]  # one read: pending and loaded of the same moment
        pending = (routes["base"] or {}).get("pending") or {}
        if len(pending.get("waiting_for", [])) == 1 and set(routes["loaded"]) >= {
            f"ctr_lora_feed:{v['b2_feed']}",
            f"ctr_lora_search:{v['b2_search']}",
        }:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"the new base never became pending with two adapters loaded: {pending}")
        time.sleep(0.05)
    new = {"ctr_lora_feed": v["b2_feed"], "ctr_lora_search": v["b2_search"], "ctr_lora_splash": v["b2_splash"]}
    return visible_ms(
        Client(url),
        body,
        lambda: client.set_registered_model_alias("ctr_lora_splash", "champion", v["b2_splash"]),
        lambda o: all(new.get(s["model"]) == s["version"] for s in o["served_by"]),
    )
