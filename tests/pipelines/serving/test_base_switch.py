"""A new ctr_base@champion without a restart: the pure plan, then the router on a real MLflow store
(the old pair serves until every champion is on the new base, then all slots switch in one swap)."""

from __future__ import annotations

import threading

import mlflow
import numpy as np
import pytest

from pipelines.serving import base_switch
from pipelines.serving.base_store import BaseStore
from pipelines.serving.loader import RefusedVersion, VersionRef
from pipelines.serving.router import AdapterServer
from tests.pipelines.serving import fixtures
from tests.pipelines.serving.test_router import pyfunc_predict, sample

SLOTS = fixtures.SLOTS
OLD, NEW = "a" * 64, "b" * 64


def _ref(model: str, version: str, fp: str) -> VersionRef:
    return VersionRef(model, version, {"base.fingerprint": fp})


# ----------------------------------------------------------------------------- the plan (pure)


def test_plan_waits_until_every_champion_is_on_the_new_base():
    resolved = {("m_a", "champion"): _ref("m_a", "2", NEW), ("m_b", "champion"): _ref("m_b", "1", OLD)}
    p = base_switch.plan(resolved, NEW)
    assert not p.ready and p.waiting == ("m_b@champion: v1 is on another base",)
    assert p.held == {("m_a", "champion")} and set(p.on_new) == {("m_a", "champion")}

    resolved[("m_b", "champion")] = _ref("m_b", "2", NEW)
    p = base_switch.plan(resolved, NEW)
    assert p.ready and p.waiting == () and set(p.on_new) == set(resolved)


def test_plan_drops_an_old_base_canary_and_waits_on_a_refused_champion():
    resolved = {("m_a", "champion"): _ref("m_a", "2", NEW), ("m_a", "canary"): _ref("m_a", "1", OLD)}
    p = base_switch.plan(resolved, NEW)
    assert p.ready and p.dropped == ("m_a@canary: v1 is on another base",) and set(p.on_new) == {("m_a", "champion")}

    p = base_switch.plan(resolved, NEW, refused={"m_a:2": "integrity"})
    assert not p.ready and p.waiting == ("m_a@champion: v2 was refused by the new base (integrity)",)
    assert p.held == {("m_a", "champion")}, "held on the old base: the new base cannot serve it either"


def test_plan_with_no_champions_is_ready_at_once():
    assert base_switch.plan({}, NEW).ready


# ----------------------------------------------------------------------------- the router


def test_the_old_pair_serves_until_every_champion_is_on_the_new_base_then_all_slots_switch(registry):
    server = AdapterServer(SLOTS)
    frame = fixtures.rows(300, "2024-01-11")
    before = server.score(frame, return_versions=True)
    new = registry.new_base(seed=7)
    new_versions = {}
    for i, slot in enumerate(SLOTS[:-1]):
        new_versions[slot] = registry.adapter(slot, seed=200 + i, on=new)
        report = server.refresh()
        pending = report["base"]["pending"]
        assert pending["version"] == f"ctr_base:{new[0].version}"
        assert report["base"]["serving"] == "ctr_base:1" and report["base"]["stale"]
        assert len(pending["waiting_for"]) == len(SLOTS) - 1 - i
        # the old pair serves unchanged, and a champion already on the new base is held, not refused
        assert not report["swapped"] and report["refused"] == []
        after = server.score(frame, return_versions=True)
        np.testing.assert_array_equal(after[0], before[0])
        assert (after[1] == before[1]).all()
    assert sample(server, "lora_base_pending") == 1
    assert sample(server, "lora_base", {"version": f"ctr_base:{new[0].version}", "state": "pending"}) == 1
    assert sample(server, "lora_refused_loads_total", {"reason": "base_mismatch"}) == 0
    assert {f"{fixtures.adapter_name(s)}:{v}" for s, v in new_versions.items()} <= set(server.loaded_versions()), (
        "the new base's adapters are loaded as they arrive, so the switch waits for the last one only"
    )

    new_versions[SLOTS[-1]] = registry.adapter(SLOTS[-1], seed=299, on=new)
    report = server.refresh()
    assert report["swapped"] and report["base"] == {
        "serving": f"ctr_base:{new[0].version}",
        "champion": f"ctr_base:{new[0].version}",
        "stale": False,
        "pending": None,
    }
    assert report["routes"] == {
        f"{fixtures.adapter_name(s)}@champion": f"{fixtures.adapter_name(s)}:{v}" for s, v in new_versions.items()
    }
    probs, versions = server.score(frame, return_versions=True)
    for s in SLOTS:
        rows = frame["slot"].to_numpy() == s
        assert set(versions[rows]) == {f"{fixtures.adapter_name(s)}:{new_versions[s]}"}
        np.testing.assert_allclose(
            probs[rows], pyfunc_predict(f"models:/{fixtures.adapter_name(s)}@champion", frame[rows]), atol=1e-6, rtol=0
        )
    assert np.abs(probs - before[0]).max() > 1e-3
    assert server.base_ref.key == f"ctr_base:{new[0].version}"
    assert not any(k.endswith(":1") for k in server.loaded_versions()), "the old base's adapters left with it"
    assert sorted(report["unloaded"]) == [f"{fixtures.adapter_name(s)}:1" for s in SLOTS]
    assert sample(server, "lora_adapter_unloads_total") == len(SLOTS)
    assert sample(server, "lora_base_switches_total") == 1 and sample(server, "lora_base_pending") == 0
    assert server.metrics_registry.get_sample_value("lora_base", {"version": "ctr_base:1", "state": "serving"}) is None
    assert sample(server, "lora_base", {"version": f"ctr_base:{new[0].version}", "state": "serving"}) == 1


def test_scoring_threads_never_see_an_adapter_on_the_wrong_base_during_a_base_switch(registry):
    server = AdapterServer(SLOTS)
    frame = fixtures.rows(200, "2024-01-11")
    old_scores = server.score(frame, return_versions=True)
    new = registry.new_base(seed=8)
    for i, slot in enumerate(SLOTS):
        registry.adapter(slot, seed=300 + i, on=new, alias=None)
    stop, errors, seen = threading.Event(), [], []

    def worker() -> None:
        while not stop.is_set():
            try:
                seen.append(server.score(frame, return_versions=True))
            except Exception as exc:  # reported below
                errors.append(exc)
                return

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    for slot in SLOTS:  # the champions move one by one under load; the switch comes with the last
        registry.set_alias(fixtures.adapter_name(slot), "champion", registry.versions[fixtures.adapter_name(slot)][-1])
        server.refresh()
    new_scores = server.score(frame, return_versions=True)
    n = len(seen)
    while len(seen) < n + 6 and not errors:
        threading.Event().wait(0.01)
    stop.set()
    for t in threads:
        t.join(30)

    assert errors == [] and server.base_ref.key == f"ctr_base:{new[0].version}"
    kinds = set()
    for probs, versions in seen:  # every response is wholly the old pair or wholly the new one
        ref = old_scores if (versions == old_scores[1]).all() else new_scores
        assert (versions == ref[1]).all(), f"a response mixed bases: {set(versions)}"
        np.testing.assert_array_equal(probs, ref[0])
        kinds.add(ref is new_scores)
    assert kinds == {False, True}


def test_a_new_base_that_fails_its_fingerprint_is_refused_and_the_old_pair_keeps_serving(registry):
    server = AdapterServer(SLOTS)
    frame = fixtures.rows(100, "2024-01-11")
    before = server.score(frame)
    new_version, _ = registry.new_base(seed=9)
    mlflow.MlflowClient().set_model_version_tag("ctr_base", new_version.version, "fingerprint", "f" * 64)

    report = server.refresh()
    assert report["base"]["serving"] == "ctr_base:1" and report["base"]["stale"]
    (why,) = report["base"]["pending"]["waiting_for"]
    assert why.startswith(f"ctr_base:{new_version.version}: ") and "fingerprint" in why
    np.testing.assert_array_equal(server.score(frame), before)
    assert sample(server, "lora_refused_loads_total", {"reason": "base"}) == 1
    server.refresh()  # remembered, not downloaded and counted again
    assert sample(server, "lora_refused_loads_total", {"reason": "base"}) == 1


def test_a_download_failure_on_the_new_base_waits_and_the_next_refresh_switches(registry, monkeypatch):
    server = AdapterServer(SLOTS)
    new = registry.new_base(seed=13)
    on_new = {s: registry.adapter(s, seed=400 + i, on=new) for i, s in enumerate(SLOTS)}
    fetch = BaseStore.fetch

    def broken(self, registry_, ref, dst):  # the artifact store is unreachable (outside failure)
        if ref.model == "ctr_lora_feed":
            raise RefusedVersion(ref, "download", "connection reset")
        return fetch(self, registry_, ref, dst)

    monkeypatch.setattr(BaseStore, "fetch", broken)
    report = server.refresh()
    assert report["base"]["serving"] == "ctr_base:1" and not report["swapped"]
    assert report["base"]["pending"]["waiting_for"] == [
        f"ctr_lora_feed@champion: v{on_new['feed']} was refused by the new base (download)"
    ]
    assert report["routes"]["ctr_lora_feed@champion"] == "ctr_lora_feed:1"
    monkeypatch.setattr(BaseStore, "fetch", fetch)
    report = server.refresh()  # a download is retried, not remembered
    assert report["swapped"] and report["base"]["serving"] == f"ctr_base:{new[0].version}"
    assert report["routes"]["ctr_lora_feed@champion"] == f"ctr_lora_feed:{on_new['feed']}"


def test_a_pending_base_is_dropped_with_its_adapters_when_the_alias_moves_on_or_back(registry):
    server = AdapterServer(SLOTS)
    second = registry.new_base(seed=14)
    v_second = registry.adapter("feed", seed=500, on=second)
    assert server.refresh()["base"]["pending"]["version"] == f"ctr_base:{second[0].version}"
    assert f"ctr_lora_feed:{v_second}" in server.loaded_versions()

    third, _ = registry.new_base(seed=15)  # a third base, refused: the second is dropped all the same
    mlflow.MlflowClient().set_model_version_tag("ctr_base", third.version, "fingerprint", "e" * 64)
    report = server.refresh()
    assert report["base"]["pending"]["version"] == f"ctr_base:{third.version}"
    assert f"ctr_lora_feed:{v_second}" in report["unloaded"] and sample(server, "lora_base_pending") == 0
    assert (
        server.metrics_registry.get_sample_value(
            "lora_base", {"version": f"ctr_base:{second[0].version}", "state": "pending"}
        )
        is None
    )

    registry.set_alias("ctr_base", "champion", second[0].version)  # the second again: pending again
    assert server.refresh()["base"]["pending"]["version"] == f"ctr_base:{second[0].version}"
    registry.set_alias("ctr_base", "champion", "1")  # and back: nothing pending, all freed
    report = server.refresh()
    assert report["base"]["pending"] is None and not report["base"]["stale"]
    assert f"ctr_lora_feed:{v_second}" in report["unloaded"]
    assert report["routes"]["ctr_lora_feed@champion"] == "ctr_lora_feed:1", "an adapter of another base never serves"
    assert server.loaded_versions() == sorted(f"{fixtures.adapter_name(s)}:1" for s in SLOTS)


def test_a_request_in_flight_across_a_base_switch_finishes_on_the_old_pair(registry, monkeypatch):
    server = AdapterServer(SLOTS)
    frame = fixtures.rows(100, "2024-01-11")
    before = server.score(frame, return_versions=True)
    with fixtures.request_in_flight(server, frame, monkeypatch) as result:
        new = registry.new_base(seed=16)
        for i, slot in enumerate(SLOTS):
            registry.adapter(slot, seed=600 + i, on=new)
        report = server.refresh()
        assert report["swapped"] and report["unloaded"] == [] and len(report["draining"]) == len(SLOTS)
        assert "ctr_lora_feed:1" in server.loaded_versions(), "the leased table's adapters stay until it ends"
    np.testing.assert_array_equal(result["r"][0], before[0])
    assert (result["r"][1] == before[1]).all()
    assert not any(k.endswith(":1") for k in server.loaded_versions())
    assert sample(server, "lora_adapter_unloads_total") == len(SLOTS)


# ----------------------------------------------------------------------------- the cap on versions held


def test_a_revert_to_an_idle_version_is_a_swap_and_idle_versions_past_the_cap_are_evicted_lru(registry):
    server = AdapterServer(SLOTS, max_loaded_adapters=5)  # the 3 champions + 2 idle
    v2 = registry.adapter("feed", seed=51)
    assert server.refresh()["loaded"] == [f"ctr_lora_feed:{v2}"]
    registry.set_alias("ctr_lora_feed", "champion", "1")  # the revert: v1 is idle in memory
    report = server.refresh()
    assert report["swapped"] and report["loaded"] == [] and report["unloaded"] == []
    assert report["routes"]["ctr_lora_feed@champion"] == "ctr_lora_feed:1"

    v3, v4 = registry.adapter("feed", seed=52), registry.adapter("feed", seed=53)
    report = server.refresh()  # champion v4; idle: v1 (routed just now), v2 (routed before), v3 (never)
    assert report["loaded"] == [f"ctr_lora_feed:{v4}"]
    held = set(server.loaded_versions())
    assert len(held) == 5 and {f"ctr_lora_feed:{v4}", "ctr_lora_feed:1"} <= held
    assert f"ctr_lora_feed:{v2}" in held and report["unloaded"] == [], "v3 was never loaded: nothing to evict"
    registry.set_alias("ctr_lora_feed", "champion", v3)
    report = server.refresh()  # v3 loads; v2 is the least recently routed idle version
    assert report["unloaded"] == [f"ctr_lora_feed:{v2}"] and len(server.loaded_versions()) == 5
    assert sample(server, "lora_loaded_adapters") == 5 and sample(server, "lora_loaded_cap_exceeded") == 0


def test_routed_versions_are_never_evicted_the_cap_is_reported_exceeded(registry):
    server = AdapterServer(SLOTS, max_loaded_adapters=2)
    assert len(server.routes()) == 3 and len(server.loaded_versions()) == 3
    assert sample(server, "lora_loaded_cap_exceeded") == 1
    with pytest.raises(ValueError, match="max_loaded_adapters"):
        AdapterServer(SLOTS, max_loaded_adapters=-1)


# ----------------------------------------------------------------------------- the load budget


def test_moves_already_in_memory_go_live_before_a_load_that_misses_the_budget(registry):
    server = AdapterServer(SLOTS, load_budget_ms=0)  # every load is past the budget
    v2 = registry.adapter("feed", seed=71)
    server.refresh()  # a move: feed v2 loads late, then switches
    assert sample(server, "lora_slow_loads_total") == 1
    registry.set_alias("ctr_lora_feed", "champion", "1")
    server.refresh()  # back to v1, idle in memory: no load at all
    swaps = sample(server, "lora_swaps_total")
    registry.set_alias("ctr_lora_feed", "champion", v2)  # in memory: goes live at once
    search = registry.adapter("search", seed=72)  # a download: misses the budget
    report = server.refresh()
    assert report["routes"]["ctr_lora_feed@champion"] == f"ctr_lora_feed:{v2}"
    assert report["routes"]["ctr_lora_search@champion"] == f"ctr_lora_search:{search}"
    assert report["loaded"] == [f"ctr_lora_search:{search}"] and report["refused"] == []
    assert sample(server, "lora_swaps_total") == swaps + 2, "feed's move first, search's once loaded"
    assert sample(server, "lora_slow_loads_total") == 2
    fresh = AdapterServer(SLOTS, load_budget_ms=0)  # first routes have no previous version to keep
    assert sample(fresh, "lora_slow_loads_total") == 0 and len(fresh.routes()) == 3
