"""Smoke tests of the training benchmark on a tiny configuration (no timing assertions)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pipelines.bench import training as bt

STEPS, WARMUP, BUCKETS, BATCH = 3, 1, 1 << 12, 64


@pytest.fixture(scope="module")
def results():
    data = bt.make_tokens((STEPS + WARMUP) * BATCH, BUCKETS)
    return {
        v: bt._measure(v, steps=STEPS, warmup=WARMUP, id_buckets=BUCKETS, batch_size=BATCH, data=data)
        for v in bt.VARIANTS
    }


def test_make_tokens_is_deterministic_and_in_range():
    x1, y1 = bt.make_tokens(300, BUCKETS)
    x2, y2 = bt.make_tokens(300, BUCKETS)
    assert x1.shape == (300, 9) and x1.dtype == np.int64 and y1.dtype == np.float32
    assert np.array_equal(x1, x2) and np.array_equal(y1, y2)
    assert x1.min() >= 0 and x1[:, :2].max() < BUCKETS


def test_variants_start_from_the_same_weights():
    sd = {v: bt.build(v, BUCKETS)[0].state_dict() for v in bt.VARIANTS}
    w = "embeddings.user_id.weight"
    assert torch.equal(sd["full"][w], sd["sparse_full"][w])
    assert torch.equal(sd["full"][w], sd["lora"][f"base_model.model.{w}"])


def test_measure_per_variant(results):
    for v, r in results.items():
        assert r["variant"] == v and r["steps"] == STEPS and r["batch_size"] == BATCH
        for k in ("samples_per_s", "step_ms_median", "peak_rss_mib", "forward_ms", "backward_ms", "optimizer_ms"):
            assert isinstance(r[k], float) and r[k] > 0, (v, k)
        for k in ("optimizer_state_bytes", "trainable_params", "total_params", "artifact_bytes"):
            assert isinstance(r[k], int) and r[k] > 0, (v, k)
        assert np.isfinite(r["first_loss"]) and np.isfinite(r["last_loss"])
    # same weights and same first batch: the first loss is the same for all three
    assert results["full"]["first_loss"] == pytest.approx(results["lora"]["first_loss"])
    assert results["full"]["first_loss"] == pytest.approx(results["sparse_full"]["first_loss"])
    lo, sp, de = results["lora"], results["sparse_full"], results["full"]
    assert lo["trainable_fraction"] < 0.01
    assert sp["trainable_fraction"] == de["trainable_fraction"] == 1.0
    assert lo["optimizer_state_bytes"] < sp["optimizer_state_bytes"] <= de["optimizer_state_bytes"]
    assert lo["artifact_bytes"] < sp["artifact_bytes"] == de["artifact_bytes"]


def test_summarize_keys_types_and_ratios(results):
    out = bt.summarize(results)
    json.dumps(out)  # JSON-safe
    for k in (
        "lora_samples_per_s",
        "full_samples_per_s",
        "sparse_full_samples_per_s",
        "speedup",
        "speedup_vs_sparse",
        "optimizer_state_ratio",
        "artifact_ratio",
        "trainable_fraction",
    ):
        assert isinstance(out[k], float) and out[k] > 0, k
    goals = [k for k in out if k.startswith("goal_")]
    assert len(goals) == 5 and all(isinstance(out[k], bool) for k in goals)
    assert out["all_goals_met"] == all(out[k] for k in goals)
    assert 0 < out["optimizer_state_ratio"] < 1 and 0 < out["artifact_ratio"] < 1
    assert out["trainable_fraction"] < 0.01 and out["goal_trainable_lt_1pct"]
    assert out["speedup"] == pytest.approx(out["lora_samples_per_s"] / out["full_samples_per_s"], rel=1e-3)
    # flat: no nested values except the per-round lists
    assert all(not isinstance(v, dict) for v in out.values())


def test_paired_measurement_and_summary(results):
    data = bt.make_tokens((STEPS + WARMUP) * BATCH, BUCKETS)
    paired = bt._paired(steps=STEPS, warmup=WARMUP, id_buckets=BUCKETS, batch_size=BATCH, data=data)
    assert paired["speedup_vs_sparse_paired"] > 0 and 0 <= paired["paired_steps_lora_faster_fraction"] <= 1
    out = bt.summarize(results, paired)
    json.dumps(out)
    assert isinstance(out["goal_faster_than_sparse_paired"], bool) and out["paired_steps"] == STEPS
    assert out["all_goals_met"] == all(out[k] for k in out if k.startswith("goal_") and not k.endswith("_paired"))


def test_unknown_variant_is_rejected():
    with pytest.raises(ValueError, match="unknown variant"):
        bt.build("nope", BUCKETS)
