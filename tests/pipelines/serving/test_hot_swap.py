"""Hot swap: refreshes while other threads score never fail a request nor mix versions in one."""

from __future__ import annotations

import threading
import time

import numpy as np

from pipelines.serving.router import AdapterServer
from tests.pipelines.serving import fixtures

SLOTS = fixtures.SLOTS
THREADS = 3
SWAPS = 6


def _references(server: AdapterServer, registry, frame, v_old: str, v_new: str) -> dict[str, np.ndarray]:
    """What the batch scores to under each feed version (same server, same batch: bit-identical)."""
    out = {}
    for v in (v_old, v_new):
        registry.set_alias("ctr_lora_feed", "champion", v)
        server.refresh()
        out[f"ctr_lora_feed:{v}"] = server.score(frame)
    return out


def test_scoring_threads_see_exactly_one_version_per_request_while_the_champion_flips(registry):
    server = AdapterServer(SLOTS, max_loaded_adapters=3)  # no idle version kept: each flip loads and unloads
    frame = fixtures.rows(400, "2024-01-11")
    feed = frame["slot"].to_numpy() == "feed"
    v_old, v_new = "1", registry.adapter("feed", seed=42, alias=None)
    refs = _references(server, registry, frame, v_old, v_new)
    assert np.abs(refs[f"ctr_lora_feed:{v_old}"] - refs[f"ctr_lora_feed:{v_new}"]).max() > 1e-3

    stop, errors, seen = threading.Event(), [], [[] for _ in range(THREADS)]

    def worker(i: int) -> None:
        while not stop.is_set():
            try:
                probs, versions = server.score(frame, return_versions=True)
            except Exception as exc:  # the assertion below reports it
                errors.append(exc)
                return
            seen[i].append((probs, versions))

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(THREADS)]
    for t in threads:
        t.start()
    for n in range(SWAPS):
        counts = [len(s) for s in seen]
        registry.set_alias("ctr_lora_feed", "champion", v_new if n % 2 else v_old)  # starts on v_new
        report = server.refresh()
        assert report["swapped"] and report["refused"] == []
        deadline = time.monotonic() + 30  # let every thread score on the new table before flipping again
        while any(len(s) < c + 2 for s, c in zip(seen, counts)) and not errors and time.monotonic() < deadline:
            time.sleep(0.005)
    stop.set()
    for t in threads:
        t.join(timeout=30)

    assert errors == []
    responses = [r for s in seen for r in s]
    kinds = set()
    for probs, versions in responses:
        feed_versions = set(versions[feed])
        assert len(feed_versions) == 1, f"one request mixed versions {feed_versions}"
        (key,) = feed_versions
        np.testing.assert_array_equal(probs, refs[key])
        kinds.add(key)
    assert kinds == set(refs), "both versions served during the test"
    # after the last request released its table, only the final champion is in memory
    final = v_new if SWAPS % 2 == 0 else v_old
    assert [v for v in server.loaded_versions() if v.startswith("ctr_lora_feed")] == [f"ctr_lora_feed:{final}"]
    swaps = server.metrics_registry.get_sample_value("lora_swaps_total")
    assert swaps == 1 + 1 + SWAPS, swaps  # start + the reference switch to v_new (v_old was no-op) + flips
    assert server.metrics_registry.get_sample_value("lora_active_adapters") == 3


def test_in_flight_request_finishes_on_its_table_and_the_old_version_unloads_after_it(registry, monkeypatch):
    server = AdapterServer(SLOTS, max_loaded_adapters=3)
    frame = fixtures.rows(100, "2024-01-11")
    before = server.score(frame, return_versions=True)
    with fixtures.request_in_flight(server, frame, monkeypatch) as result:
        v2 = registry.adapter("feed", seed=42)
        report = server.refresh()
        assert report["swapped"] and report["unloaded"] == [] and report["draining"] == ["ctr_lora_feed:1"]
        assert {"ctr_lora_feed:1", f"ctr_lora_feed:{v2}"} <= set(server.loaded_versions())
        assert f"ctr_lora_feed:{v2}" in set(server.score(frame, return_versions=True)[1])
    probs, versions = result["r"]
    np.testing.assert_array_equal(probs, before[0])
    assert (versions == before[1]).all()
    assert "ctr_lora_feed:1" not in server.loaded_versions()
    assert server.metrics_registry.get_sample_value("lora_adapter_unloads_total") == 1
