"""Smoke tests of the training benchmark on a tiny configuration (no timing assertions)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from pipelines.bench import training as bt

STEPS, WARMUP, BUCKETS, BATCH = 3, 1, 1 << 12, 64


@pytest.fixture(scope="module")
def results():
    data = bt.make_tokens((STEPS + WARMUP) * BATCH, BUCKETS)
    return {v: bt._measure(v, steps=STEPS, warmup=WARMUP, id_buckets=BUCKETS, batch_size=BATCH, data=data)
            for v in bt.VARIANTS}


def test_make_tokens_is_deterministic_and_in_range():
    x1, y1 = bt.make_tokens(300, BUCKETS)
    x2, y2 = bt.make_tokens(300, BUCKETS)
    assert x1.shape == (300, 9) and x1.dtype == np.int64 and y1.dtype == np.float32
    assert np.array_equal(x1, x2) and np.array_equal(y1, y2)
    assert x1.min() >= 0 and x1[:, :2].max() < BUCKETS


def test_variants_start_from_the_same_weights():
    import torch

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
    json.dumps(out)   # JSON-safe
    for k in ("lora_samples_per_s", "full_samples_per_s", "sparse_full_samples_per_s", "speedup",
              "speedup_vs_sparse", "optimizer_state_ratio", "artifact_ratio", "trainable_fraction"):
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


# ------------------------------------------------------------------------ quality benchmark smoke test
def test_bench_quality_tiny_run():
    from pipelines.bench import quality as bq
    from pipelines.config import LoraTrainConfig, ModelConfig
    from pipelines.data import movielens

    frame = movielens.load().iloc[::25].reset_index(drop=True)     # 4,000 rows spread over the whole period
    grid = (bq.BaseCandidate(model=ModelConfig(embed_dim=8, n_blocks=1, id_buckets=1 << 10), max_epochs=2,
                             warmup_steps=2),)
    seen = []

    def distilled(ctx, stage):
        seen.append(stage)
        assert isinstance(ctx, bq.QualityContext) and (ctx.base_dir / "weights.safetensors").exists()
        rows = ctx.val if stage == "val" else ctx.test
        return np.full(len(rows), 0.5) if stage == "test" else None

    r = bq.run(distilled=distilled, frame=frame, base_grid=grid, lr_grid=(1.0,),
               lora_cfg=LoraTrainConfig(min_rows=50, batch_size=128), lora_max_epochs=1, spread_seeds=1)
    json.dumps(r)
    assert seen == ["val", "test"]
    assert r["train_rows"] == 3200 and r["test_rows"] == 800 and 0.5 < r["test_cold_share"] < 1
    for name in ("lr", "base", "lora"):
        for k in ("auc", "auc_cold", "auc_warm", "logloss"):
            assert isinstance(r[f"{name}_{k}"], float), (name, k)
        assert 0.4 < r[f"{name}_auc"] < 1
    assert r["distilled_auc"] == 0.5 and r["distilled_val_auc"] is None
    assert r["best_model"] in ("base", "lora") and isinstance(r["goal_met"], bool)
    assert r["lr_C"] == 1.0 and r["base_epochs"] in (1, 2) and set(r["lora_epochs_by_slot"]) == set(movielens.SLOTS)
    assert set(r["table"]) == {"lr", "base", "lora", "distilled"}
    assert bq.markdown_table(r).count("\n") == 5


def test_temporal_split_and_cold_mask():
    import pandas as pd

    from pipelines.bench import quality as bq

    ts = pd.to_datetime([3, 1, 2, 5, 4], unit="s", utc=True)
    f = pd.DataFrame({"event_ts": ts, "user_id": ["a", "b", "a", "c", "b"]})
    tr, te = bq.temporal_split(f, 0.6)
    assert list(tr["event_ts"]) == sorted(ts)[:3] and list(te["event_ts"]) == sorted(ts)[3:]
    assert bq.cold_mask(tr, te).tolist() == [False, True]     # b (t=4) seen in train, c (t=5) not
