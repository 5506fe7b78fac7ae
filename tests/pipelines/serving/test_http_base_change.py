"""The real serving process under concurrent load while a champion is promoted, reverted, and then the
base itself changes: no request fails, none is scored by a version its table did not name (checked with
the benchmark's own checker, `pipelines.bench.serving_http`), and the old pair serves until the new one
is complete."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from pipelines.bench import serving_http
from pipelines.registry import pyfunc
from tests.pipelines.serving import fixtures
from tests.pipelines.serving.http_server import serve

pytestmark = pytest.mark.slow


def test_promote_revert_and_base_change_under_load_fail_and_misroute_nothing(registry, tmp_path):
    frame = fixtures.rows(32, "2024-01-11")
    body = serving_http._body(frame)
    v2 = registry.adapter("feed", seed=11, alias=None)
    new = registry.new_base(seed=12, alias=None)
    on_new = {s: registry.adapter(s, seed=20 + i, alias=None, on=new) for i, s in enumerate(fixtures.SLOTS)}
    stop = threading.Event()
    with serve(tmp_path, poll_seconds=0.2) as http, serving_http.RouteWatcher(http.url) as watcher:
        box = {}
        clients = threading.Thread(
            target=lambda: box.setdefault("records", serving_http.load(http.url, body, until=stop, clients=4))
        )
        clients.start()
        try:
            registry.set_alias("ctr_lora_feed", "champion", v2)  # a promotion
            watcher.wait_for(lambda r: r["ctr_lora_feed@champion"] == f"ctr_lora_feed:{v2}")
            registry.set_alias("ctr_lora_feed", "champion", "1")  # a revert
            watcher.wait_for(lambda r: r["ctr_lora_feed@champion"] == "ctr_lora_feed:1")
            registry.set_alias("ctr_base", "champion", new[0].version)  # the base, then its champions
            for slot in fixtures.SLOTS[:-1]:
                registry.set_alias(fixtures.adapter_name(slot), "champion", on_new[slot])
            pending = http.wait_for(
                lambda: (
                    len((http.call("/routes")[1]["base"]["pending"] or {}).get("waiting_for", [])) == 1
                    and http.call("/routes")[1]
                )
            )
            assert pending["routes"] == {
                f"{fixtures.adapter_name(s)}@champion": f"{fixtures.adapter_name(s)}:1" for s in fixtures.SLOTS
            }, "the old pair serves while the new one waits"
            last = fixtures.SLOTS[-1]
            registry.set_alias(fixtures.adapter_name(last), "champion", on_new[last])
            watcher.wait_for(
                lambda r: all(
                    r[f"{fixtures.adapter_name(s)}@champion"] == f"{fixtures.adapter_name(s)}:{v}"
                    for s, v in on_new.items()
                )
            )
            after = http.score(frame)
        finally:
            stop.set()
            clients.join(60)
        routes = http.call("/routes")[1]
        metrics = http.call("/metrics")[1]
    records = box["records"]
    slots = frame["slot"].tolist()
    assert len(records) > 20
    assert [r[0] for r in records if r[0] != 200] == [], "failed requests"
    assert sum(serving_http.misrouted(r, slots, watcher) for r in records) == 0
    seen = {tuple(sorted({(s["model"], s["version"]) for s in r[1]["served_by"]})) for r in records}
    old = tuple(sorted((fixtures.adapter_name(s), "1") for s in fixtures.SLOTS))
    assert old in seen and len(seen) >= 3, "the load saw the old pair, the promotion and the new pair"
    assert {(s["model"], s["version"]) for s in after["served_by"]} == {
        (fixtures.adapter_name(s), v) for s, v in on_new.items()
    }
    assert routes["base"]["serving"] == f"ctr_base:{new[0].version}" and routes["base"]["pending"] is None
    # the version names could be right while the numbers came from the wrong base: check the numbers
    expected = {}
    for out in (r[1] for r in records):
        for model, version in {(s["model"], s["version"]) for s in out["served_by"]} - set(expected):
            expected[(model, version)] = np.asarray(pyfunc.load(f"models:/{model}/{version}").predict(frame)).ravel()
        want = [expected[(s["model"], s["version"])][i] for i, s in enumerate(out["served_by"])]
        np.testing.assert_allclose(out["predictions"], want, atol=1e-5, rtol=0)
    assert "lora_base_switches_total 1.0" in metrics and "lora_base_pending 0.0" in metrics
