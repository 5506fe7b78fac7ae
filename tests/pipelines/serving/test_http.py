"""`python -m pipelines serve` as a real process: MLflow's scoring protocol over HTTP, the pyfunc's
numbers, 4xx for what it refuses, and alias moves followed without a restart (polling here; the
webhook path runs against a real `mlflow server` in test_http_webhook.py)."""

from __future__ import annotations

import json
import threading

import mlflow
import numpy as np
import pytest

from pipelines.registry import pyfunc
from tests.conftest import use_store_copy
from tests.pipelines.serving import fixtures
from tests.pipelines.serving.http_server import Served, mlflow_models_serve, serve, split, wait_ready

pytestmark = pytest.mark.slow


def _pyfunc_scores(frame) -> tuple[np.ndarray, list[dict]]:
    """Each row scored by its slot's champion through the registry's trusted pyfunc load."""
    out, served = np.zeros(len(frame)), [None] * len(frame)
    for slot, rows in frame.groupby("slot").groups.items():
        uri = f"models:/{fixtures.adapter_name(slot)}@champion"
        out[rows] = np.asarray(pyfunc.load(uri).predict(frame.loc[rows])).ravel()
        version = pyfunc.registry_record(uri)[0]
        for i in rows:
            served[i] = version
    return out, served


def test_scores_over_http_equal_the_pyfunc_and_name_the_version_of_every_row(registry, tmp_path):
    frame = fixtures.rows(120, "2024-01-11")
    expected, _ = _pyfunc_scores(frame)
    with serve(tmp_path) as http:
        by_split = http.score(frame)
        records = json.loads(frame.to_json(orient="records", date_format="iso"))
        status, by_records = http.call("/invocations", {"dataframe_records": records})
        metrics = http.call("/metrics")[1]
        routes = http.call("/routes")[1]
    assert status == 200
    np.testing.assert_allclose(by_split["predictions"], expected, atol=1e-6, rtol=0)
    np.testing.assert_allclose(by_records["predictions"], expected, atol=1e-6, rtol=0)
    served = {(r["model"], r["version"]) for r in by_split["served_by"]}
    assert served == {(fixtures.adapter_name(s), "1") for s in fixtures.SLOTS}
    assert [r["model"] for r in by_split["served_by"]] == [fixtures.adapter_name(s) for s in frame["slot"]]
    assert routes["routes"] == {
        f"{fixtures.adapter_name(s)}@champion": f"{fixtures.adapter_name(s)}:1" for s in fixtures.SLOTS
    }
    assert routes["base"]["serving"] == "ctr_base:1" and routes["base"]["stale"] is False
    assert 'lora_requests_total{status="200"} 2.0' in metrics
    assert f'lora_rows_scored_total{{version="ctr_lora_feed:1"}} {2.0 * (frame["slot"] == "feed").sum()}' in metrics


def _bodies(frame) -> dict[str, tuple[int, object]]:
    """Malformed requests and the status each must get."""
    good = split(frame.head(3))["dataframe_split"]
    col = good["columns"].index

    def with_value(name, value):
        data = [list(r) for r in good["data"]]
        data[1][col(name)] = value
        return {"dataframe_split": {"columns": good["columns"], "data": data}}

    no_item = {
        "dataframe_split": {
            "columns": [c for c in good["columns"] if c != "item_id"],
            "data": [[v for c, v in zip(good["columns"], r) if c != "item_id"] for r in good["data"]],
        }
    }
    return {
        "missing field": (422, no_item),
        "hour is text": (422, with_value("hour", "noon")),
        "hour out of range": (422, with_value("hour", 300)),
        "hour is a float": (422, with_value("hour", 7.5)),
        "user_id is a number": (422, with_value("user_id", 17)),
        "user_id is null": (422, with_value("user_id", None)),
        "unknown slot": (422, with_value("slot", "homepage")),
        "no format": (400, {"rows": good["data"]}),
        "both formats": (400, {"dataframe_split": good, "dataframe_records": []}),
        "ragged row": (400, {"dataframe_split": {"columns": good["columns"], "data": [good["data"][0][:3]]}}),
        "records not objects": (400, {"dataframe_records": [1, 2]}),
        "a list body": (400, [1, 2, 3]),
    }


def test_malformed_requests_get_a_4xx_with_a_message_never_a_500(registry, tmp_path):
    frame = fixtures.rows(20, "2024-01-11")
    with serve(tmp_path) as http:
        answers = {name: http.call("/invocations", body) for name, (_, body) in _bodies(frame).items()}
        answers["not JSON"] = http.call("/invocations", raw=b"{not json")
        answers["10 MB body"] = http.call("/invocations", raw=b" " * (10 * 1024 * 1024))
        answers["text/csv"] = http.call("/invocations", raw=b"a,b\n1,2", headers={"Content-Type": "text/csv"})
        answers["nested deep"] = http.call("/invocations", raw=b"[" * 100_000 + b"]" * 100_000)
        still_fine = http.call("/invocations", split(frame), headers={"Content-Type": "Application/JSON"})[1]
    expected = {name: status for name, (status, _) in _bodies(frame).items()}
    expected.update({"not JSON": 400, "10 MB body": 413, "text/csv": 415, "nested deep": 400})
    got = {name: status for name, (status, _) in answers.items()}
    assert got == expected
    for name, (_, body) in answers.items():
        assert isinstance(body, dict) and body["message"], name
    assert "item_id" in answers["missing field"][1]["message"]
    assert "'hour'" in answers["hour is text"][1]["message"] and "[1]" in answers["hour is text"][1]["message"]
    assert "homepage" in answers["unknown slot"][1]["message"]
    assert len(still_fine["predictions"]) == len(frame)


def test_a_promotion_under_load_is_followed_without_a_restart_and_a_tampered_version_never_serves(registry, tmp_path):
    frame = fixtures.rows(64, "2024-01-11")
    v_bad = registry.adapter("feed", seed=7, alias=None)
    fixtures.tamper("ctr_lora_feed", v_bad)
    v_new = registry.adapter("feed", seed=8, alias=None)
    stop, answers = threading.Event(), []
    with serve(tmp_path) as http:

        def load() -> None:
            while not stop.is_set():
                answers.append(http.call("/invocations", split(frame)))

        clients = [threading.Thread(target=load) for _ in range(4)]
        for c in clients:
            c.start()
        try:
            registry.set_alias("ctr_lora_feed", "champion", v_bad)
            refused = http.wait_for(lambda: http.call("/routes")[1]["refused"])
            assert http.routes()["ctr_lora_feed@champion"] == "ctr_lora_feed:1"  # refused: v1 keeps serving
            registry.set_alias("ctr_lora_feed", "champion", v_new)
            http.wait_for_route("ctr_lora_feed@champion", f"ctr_lora_feed:{v_new}")
            after = http.score(frame)
        finally:
            stop.set()
            for c in clients:
                c.join()
        metrics = http.call("/metrics")[1]
    assert refused[0]["version"] == v_bad and refused[0]["reason"] == "integrity"
    assert 'lora_refused_loads_total{reason="integrity"} 1.0' in metrics
    feed = (frame["slot"] == "feed").to_numpy()
    assert {r["version"] for r, f in zip(after["served_by"], feed) if f} == {v_new}
    assert answers and all(status == 200 for status, _ in answers), [a for a in answers if a[0] != 200][:3]
    for _, out in answers:  # one version per request for the moved slot, and never the tampered one
        versions = {r["version"] for r, f in zip(out["served_by"], feed) if f}
        assert len(versions) == 1 and versions <= {"1", v_new}


def test_mlflow_models_serve_scores_one_adapter_as_the_pyfunc(registry, tmp_path):
    """MLflow's own scoring server over our pyfunc (`--env-manager local`: this environment's packages)."""
    frame = fixtures.rows(60, "2024-01-11")
    feed = frame[frame["slot"] == "feed"].reset_index(drop=True)
    expected = np.asarray(pyfunc.load("models:/ctr_lora_feed@champion").predict(feed)).ravel()
    with mlflow_models_serve("models:/ctr_lora_feed@champion", tmp_path) as url:
        status, out = Served(url, tmp_path / "models-serve.log").call("/invocations", split(feed))
    assert status == 200, out
    np.testing.assert_allclose(np.asarray(out["predictions"]).ravel(), expected, atol=1e-6, rtol=0)


def test_a_server_started_before_the_first_base_waits_for_it(template_db, tmp_path, monkeypatch):
    """A new deployment: the serving process starts on an empty registry and serves once a base is champion."""
    use_store_copy(template_db, tmp_path, monkeypatch)
    try:
        with serve(tmp_path, ready=False, poll_seconds=1) as http:
            http.wait_for(lambda: "waiting for a serving base" in http.log.read_text())
            assert http.proc.poll() is None
            fixtures.build()  # the base and the slots' champions are registered
            wait_ready(http)
            out = http.score(fixtures.rows(10, "2024-01-11"))
        assert len(out["predictions"]) == 10 and {r["version"] for r in out["served_by"]} == {"1"}
    finally:
        mlflow.set_tracking_uri(None)
