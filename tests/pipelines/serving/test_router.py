"""AdapterServer: routing, canary, cold start, refresh, refusals, metrics (each on a fresh MLflow store)."""

from __future__ import annotations

import json

import mlflow
import numpy as np
import pandas as pd
import pytest

from pipelines.config import LoraTrainConfig
from pipelines.data.schema import FEATURE_FIELDS
from pipelines.errors import SchemaError
from pipelines.registry import integrity
from pipelines.serving import routing
from pipelines.serving.router import AdapterServer
from tests.pipelines.serving import fixtures

SLOTS = fixtures.SLOTS


def pyfunc_predict(uri: str, frame) -> np.ndarray:
    return np.asarray(mlflow.pyfunc.load_model(uri).predict(frame[list(FEATURE_FIELDS)]), dtype=np.float64)


def sample(server: AdapterServer, name: str, labels: dict | None = None) -> float:
    return server.metrics_registry.get_sample_value(name, labels or {}) or 0.0


def test_rows_are_scored_by_their_slot_champion_and_base_without_one(registry):
    mlflow.MlflowClient().delete_registered_model_alias("ctr_lora_splash", "champion")
    server = AdapterServer(SLOTS)
    frame = fixtures.rows(300, "2024-01-11")
    probs, versions = server.score(frame, return_versions=True)

    assert probs.shape == (len(frame),) and probs.dtype == np.float32
    slot = frame["slot"].to_numpy()
    for s in ("feed", "search"):
        rows = slot == s
        assert rows.sum() > 10
        assert set(versions[rows]) == {f"ctr_lora_{s}:1"}
        np.testing.assert_allclose(
            probs[rows], pyfunc_predict(f"models:/ctr_lora_{s}@champion", frame[rows]), atol=1e-6, rtol=0
        )
    # splash has no champion: the base's output, reported as the base version
    rows = slot == "splash"
    assert rows.sum() > 0 and set(versions[rows]) == {"ctr_base:1"}
    np.testing.assert_allclose(probs[rows], pyfunc_predict("models:/ctr_base@champion", frame[rows]), atol=1e-6, rtol=0)
    # the adapters really differ from the base, or the comparison above proves nothing
    base_all = pyfunc_predict("models:/ctr_base@champion", frame)
    assert np.abs(probs[slot == "feed"] - base_all[slot == "feed"]).max() > 1e-3
    assert sample(server, "lora_active_adapters") == 2
    assert sample(server, "lora_inference_seconds_count", {"adapter": "ctr_lora_feed:1"}) == 1
    assert sample(server, "lora_inference_seconds_count", {"adapter": "ctr_base:1"}) == 1


def test_canary_share_sends_a_stable_subset_of_users_to_canary(registry):
    canary = registry.adapter("feed", seed=7, alias="canary")
    server = AdapterServer(SLOTS, canary_share=0.3)
    frame = fixtures.rows(600, "2024-01-11")
    _, versions = server.score(frame, return_versions=True)
    feed = frame["slot"].to_numpy() == "feed"
    on_canary = versions == f"ctr_lora_feed:{canary}"

    assert not on_canary[~feed].any(), "slots without a canary stay on their champion"
    users = frame.loc[feed, "user_id"].astype(str)
    canary_users = set(users[on_canary[feed]])
    assert canary_users.isdisjoint(set(users[~on_canary[feed]])), "a user is entirely in or out of the canary"
    share = len(canary_users) / users.nunique()
    assert 0.15 < share < 0.45, share
    # stable: another server (another process would hash the same) picks the same users
    again = AdapterServer(SLOTS, canary_share=0.3).score(frame, return_versions=True)[1]
    assert (again == versions).all()
    probs = server.score(frame)
    np.testing.assert_allclose(
        probs[on_canary], pyfunc_predict("models:/ctr_lora_feed@canary", frame[on_canary]), atol=1e-6, rtol=0
    )


def test_canary_mask_bounds_and_determinism():
    users = pd.Series([f"u{i}" for i in range(5000)])
    assert not routing.canary_mask(users, 0.0).any()
    assert routing.canary_mask(users, 1.0).all()
    m = routing.canary_mask(users, 0.1)
    assert 0.08 < m.mean() < 0.12
    assert (routing.canary_mask(users, 0.1) == m).all()
    assert (m <= routing.canary_mask(users, 0.2)).all(), "a larger share keeps the users of a smaller one"


def test_new_users_go_to_the_cold_start_champion(registry):
    cold = registry.adapter("feed", seed=9, name="ctr_lora_cold_start")
    frame = fixtures.rows(200, "2024-01-11")
    frame["is_new_user"] = np.arange(len(frame)) % 4 == 0
    server = AdapterServer(SLOTS)
    probs, versions = server.score(frame, return_versions=True)
    new = frame["is_new_user"].to_numpy()
    assert set(versions[new]) == {f"ctr_lora_cold_start:{cold}"}
    assert not any(v.startswith("ctr_lora_cold_start") for v in versions[~new])
    np.testing.assert_allclose(
        probs[new], pyfunc_predict("models:/ctr_lora_cold_start@champion", frame[new]), atol=1e-6, rtol=0
    )
    # a callable marks new users as well; without the column nobody is new
    by_callable = AdapterServer(SLOTS, new_users=lambda f: f["user_id"].isin(frame.loc[new, "user_id"]))
    assert (by_callable.score(frame, return_versions=True)[1][new] == versions[new]).all()
    assert not any(
        v.startswith("ctr_lora_cold_start")
        for v in server.score(frame.drop(columns="is_new_user"), return_versions=True)[1]
    )


def test_refresh_serves_the_moved_champion_and_unloads_the_old_past_the_cap(registry):
    server = AdapterServer(SLOTS, max_loaded_adapters=3)  # room for the three champions only
    frame = fixtures.rows(200, "2024-01-11")
    feed = frame["slot"].to_numpy() == "feed"
    before = server.score(frame)
    v2 = registry.adapter("feed", seed=42)  # registered with alias champion: the alias moves

    report = server.refresh()
    assert report["swapped"] and report["loaded"] == [f"ctr_lora_feed:{v2}"]
    assert report["unloaded"] == ["ctr_lora_feed:1"] and report["refused"] == [] and report["draining"] == []
    assert report["routes"]["ctr_lora_feed@champion"] == f"ctr_lora_feed:{v2}"
    assert report["base"] == {"serving": "ctr_base:1", "champion": "ctr_base:1", "stale": False, "pending": None}
    probs, versions = server.score(frame, return_versions=True)
    assert set(versions[feed]) == {f"ctr_lora_feed:{v2}"}
    np.testing.assert_allclose(
        probs[feed], pyfunc_predict("models:/ctr_lora_feed@champion", frame[feed]), atol=1e-6, rtol=0
    )
    assert np.abs(probs[feed] - before[feed]).max() > 1e-3
    np.testing.assert_array_equal(probs[~feed], before[~feed])
    assert "ctr_lora_feed:1" not in server.loaded_versions()
    assert len(server._table.base._peft.peft_config) == 3, (
        "the old version's PEFT adapter is deleted, not just unrouted"
    )

    again = server.refresh()
    assert not again["swapped"] and again["loaded"] == [] and again["unloaded"] == []
    assert sample(server, "lora_swaps_total") == 2
    assert sample(server, "lora_adapter_unloads_total") == 1


def test_adapter_trained_on_another_base_is_refused_and_the_old_one_keeps_serving(registry):
    server = AdapterServer(SLOTS)
    frame = fixtures.rows(200, "2024-01-11")
    before = server.score(frame, return_versions=True)
    bad = registry.adapter("feed", seed=42, recorded_fingerprint="0" * 64)

    report = server.refresh()
    assert [(r["version"], r["reason"]) for r in report["refused"]] == [(bad, "base_mismatch")]
    assert "fingerprint 000000000000..." in report["refused"][0]["error"]
    assert not report["swapped"] and report["routes"]["ctr_lora_feed@champion"] == "ctr_lora_feed:1"
    after = server.score(frame, return_versions=True)
    np.testing.assert_array_equal(after[0], before[0])
    assert (after[1] == before[1]).all()
    assert sample(server, "lora_refused_loads_total", {"reason": "base_mismatch"}) == 1
    # a refusal is remembered: reported again, not downloaded or counted again
    assert server.refresh()["refused"][0]["reason"] == "base_mismatch"
    assert sample(server, "lora_refused_loads_total", {"reason": "base_mismatch"}) == 1


def test_tampered_adapter_file_in_the_artifact_store_is_refused(registry):
    server = AdapterServer(SLOTS)
    frame = fixtures.rows(200, "2024-01-11")
    before = server.score(frame)
    v2 = registry.adapter("search", seed=43, alias=None)
    fixtures.tamper("ctr_lora_search", v2)
    registry.set_alias("ctr_lora_search", "champion", v2)

    report = server.refresh()
    assert [(r["model"], r["version"], r["reason"]) for r in report["refused"]] == [
        ("ctr_lora_search", v2, "integrity")
    ]
    assert "adapter_model.safetensors has sha256" in report["refused"][0]["error"]
    assert report["routes"]["ctr_lora_search@champion"] == "ctr_lora_search:1"
    np.testing.assert_array_equal(server.score(frame), before)
    assert sample(server, "lora_refused_loads_total", {"reason": "integrity"}) == 1
    assert f"ctr_lora_search:{v2}" not in server.loaded_versions()
    assert 'lora_refused_loads_total{reason="integrity"} 1.0' in server.metrics_text()


def test_request_rejects_frames_without_the_feature_columns(registry):
    server = AdapterServer(SLOTS)
    frame = fixtures.rows(10, "2024-01-11")
    with pytest.raises(SchemaError, match="occupation"):
        server.score(frame.drop(columns="occupation"))
    probs, versions = server.score(frame.iloc[:0], return_versions=True)
    assert probs.shape == (0,) and versions.shape == (0,)


def test_adapter_on_embeddings_with_another_rank_matches_its_pyfunc(registry):
    server = AdapterServer(SLOTS)
    v2 = registry.adapter(
        "search", seed=44, lora_cfg=LoraTrainConfig(r=4, alpha=8, target_modules=("q_proj", "v_proj", "embeddings"))
    )
    assert server.refresh()["loaded"] == [f"ctr_lora_search:{v2}"]
    frame = fixtures.rows(300, "2024-01-11")
    probs, versions = server.score(frame, return_versions=True)
    for s in SLOTS:  # the stacks now mix ranks 8 and 4 and layers only one adapter targets
        rows = frame["slot"].to_numpy() == s
        np.testing.assert_allclose(
            probs[rows], pyfunc_predict(f"models:/ctr_lora_{s}@champion", frame[rows]), atol=1e-6, rtol=0
        )
    assert set(versions[frame["slot"].to_numpy() == "search"]) == {f"ctr_lora_search:{v2}"}


def test_adapter_carrying_layernorm_biases_is_refused_as_unsupported(registry):
    server = AdapterServer(SLOTS)
    bad = registry.adapter("feed", seed=45, lora_cfg=LoraTrainConfig(train_layernorm_bias=True))
    report = server.refresh()
    assert [(r["version"], r["reason"]) for r in report["refused"]] == [(bad, "unsupported")]
    assert report["routes"]["ctr_lora_feed@champion"] == "ctr_lora_feed:1"
    json.dumps(report)  # JSON-safe


def test_a_version_without_its_registry_hashes_is_refused_not_checked_against_its_run(registry):
    """The version's adapter.sha256 tag is the record: removed, the training run's copy does not stand in."""
    server = AdapterServer(SLOTS)
    frame = fixtures.rows(200, "2024-01-11")
    before = server.score(frame)
    v2 = registry.adapter("feed", seed=46, alias=None)
    client = mlflow.MlflowClient()
    run_id = client.get_model_version("ctr_lora_feed", v2).run_id
    assert client.get_run(run_id).data.tags[integrity.TAG]  # still on the run
    client.delete_model_version_tag("ctr_lora_feed", v2, integrity.TAG)
    registry.set_alias("ctr_lora_feed", "champion", v2)

    report = server.refresh()
    assert [(r["version"], r["reason"]) for r in report["refused"]] == [(v2, "integrity")]
    assert "no recorded adapter file hashes" in report["refused"][0]["error"]
    assert report["routes"]["ctr_lora_feed@champion"] == "ctr_lora_feed:1"
    np.testing.assert_array_equal(server.score(frame), before)


def test_a_refresh_for_named_routes_re_reads_only_those(registry):
    """What a webhook-triggered refresh does: one registry read per named route, the rest as last read."""
    server = AdapterServer(SLOTS)
    feed, search = registry.adapter("feed", seed=61), registry.adapter("search", seed=62)  # both move
    report = server.refresh(only=[("ctr_lora_feed", "champion"), ("someone_elses_model", "champion")])
    assert report["routes"]["ctr_lora_feed@champion"] == f"ctr_lora_feed:{feed}"
    assert report["routes"]["ctr_lora_search@champion"] == "ctr_lora_search:1", "not named: as last read"
    mlflow.MlflowClient().delete_registered_model_alias("ctr_lora_splash", "champion")
    report = server.refresh(only=[("ctr_lora_splash", "champion")])
    assert "ctr_lora_splash@champion" not in report["routes"]
    assert server.refresh()["routes"]["ctr_lora_search@champion"] == f"ctr_lora_search:{search}"  # a full read
