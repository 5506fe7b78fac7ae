"""bench_quality on a small synthetic frame: the protocol's plumbing, the wide candidates, and the distilled row."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from pipelines.bench import quality as bq
from pipelines.bench import quality_distill as bqd
from pipelines.config import ColdStartConfig, LoraTrainConfig, ModelConfig
from pipelines.data.synthetic import SyntheticSpec, generate_day

SPEC = SyntheticSpec(n_users=400, n_items=120, n_advertisers=10, new_users_per_day=150, new_items_per_day=10,
                     slot_ctr=(0.3, 0.3, 0.3), seed=3)
TINY = ModelConfig(embed_dim=8, n_heads=2, n_blocks=1, id_buckets=1024, small_buckets=64)
# Plain (not `wide`) candidates keep the run short; the distilled row with a wide base is
# test_distilled_val_stage_reads_only_fit_and_keeps_warm_rows_on_the_base.
GRID = (bq.BaseCandidate(model=TINY, max_epochs=1, batch_size=256),
        bq.BaseCandidate(model=TINY, max_epochs=2, batch_size=256, drop_fields=("hour", "weekday")))
LCFG = LoraTrainConfig(r=2, alpha=4, min_rows=50, batch_size=128)
CS = ColdStartConfig(r=2, alpha=4, epochs=1, batch_size=32, transfer_batch_size=64)


@pytest.fixture(scope="module")
def frame() -> pd.DataFrame:
    return pd.concat(list(generate_day(SPEC, "2024-01-03", 3000)), ignore_index=True)


@pytest.fixture(scope="module")
def result(frame):
    return bq.run(distilled=bqd.make_distilled(CS), frame=frame, base_grid=GRID, lr_grid=(1.0,), lora_cfg=LCFG,
                  lora_max_epochs=1, spread_seeds=1)


def test_run_reports_every_row_and_the_goal(result):
    json.dumps(result)  # JSON-safe
    assert set(result["table"]) == {"lr", "base", "lora", "distilled"}
    for name, r in result["table"].items():
        assert 0.0 <= r["auc"] <= 1.0 and r["logloss"] > 0, name
        assert r["val_auc"] is not None, name
    assert "distilled_error" not in result
    assert result["best_model"] in {"base", "lora", "distilled"}
    assert isinstance(result["goal_met"], bool)
    assert len(result["base_search"]) == len(GRID)
    assert all(s["wide"] is False for s in result["base_search"])
    assert any(c.model.wide for c in bq.BASE_GRID) and not bq.BASE_GRID[0].model.wide  # defaults first
    assert result["base_seed_spread_auc"]["seeds"] == 2


def test_recent_user_rows_are_the_newest_users_first_rows(frame):
    f = frame.sort_values("event_ts", kind="stable").reset_index(drop=True)
    labelled, transfer = bqd.recent_user_rows(f, 0.25, labelled_per_user=3)
    cut = f["event_ts"].iloc[int(round(0.75 * len(f)))]
    first = f.groupby("user_id")["event_ts"].min()
    recent = set(first[first >= cut].index)
    assert recent and set(transfer["user_id"]) == recent and set(labelled["user_id"]) == recent
    assert labelled.groupby("user_id").size().max() <= 3
    assert len(transfer) == f["user_id"].isin(recent).sum()
    # each labelled row is one of its user's first three
    ranks = f[f["user_id"].isin(recent)].groupby("user_id").cumcount()
    firsts = f.loc[ranks.index[ranks < 3]]
    assert len(labelled) == len(firsts)
    with pytest.raises(ValueError):
        bqd.recent_user_rows(f, 1.0)


def _ctx(frame, tmp_path, cfg: ModelConfig, drop=(), test_part=True):
    from pipelines.model import store

    train, test = bq.temporal_split(frame, bq.TRAIN_FRACTION)
    fit, val = bq.temporal_split(train, 1.0 - bq.VAL_FRACTION)
    cand = bq.BaseCandidate(model=cfg, max_epochs=1, batch_size=256, drop_fields=drop)
    model, _ = bq.train_base(cand, fit, stop_epoch=1)
    store.save_base(model, tmp_path / "fit_base")
    ctx = bq.QualityContext(base_dir=tmp_path / "missing", fit_base_dir=tmp_path / "fit_base", model_cfg=cfg,
                            drop_fields=drop, train=None if not test_part else train,
                            test=None if not test_part else test, fit=fit, val=val, lora_cfg=LCFG)
    return ctx, model, cand


@pytest.mark.parametrize("wide", [False, True])
def test_distilled_val_stage_reads_only_fit_and_keeps_warm_rows_on_the_base(frame, tmp_path, wide):
    cfg = ModelConfig(**{**TINY.__dict__, "wide": wide})
    ctx, model, cand = _ctx(frame, tmp_path, cfg, drop=("hour",), test_part=False)  # train/test/base_dir unusable
    p = bqd.make_distilled(CS)(ctx, stage="val")
    assert p.shape == (len(ctx.val),) and np.isfinite(p).all() and ((p > 0) & (p < 1)).all()
    cold = bq.cold_mask(ctx.fit, ctx.val)
    assert cold.any() and (~cold).any()
    base_p = bq.predict_base(model, cand, ctx.val)
    np.testing.assert_allclose(p[~cold], base_p[~cold], rtol=1e-6)
    assert not np.allclose(p[cold], base_p[cold])  # the student moved away from the base on cold rows


def test_distilled_rejects_an_unknown_stage(frame, tmp_path):
    ctx, _, _ = _ctx(frame, tmp_path, TINY)
    with pytest.raises(ValueError, match="stage"):
        bqd.make_distilled(CS)(ctx, stage="train")
