"""`research.quality` (the retired `bench quality`) on a small synthetic frame (the protocol's plumbing, the wide
candidates, the distilled row, the verdict) and a tiny run on MovieLens rows."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from pipelines.bench import backtest_protocol as bp
from pipelines.config import ColdStartConfig, LoraTrainConfig, ModelConfig
from pipelines.data import movielens
from pipelines.data.synthetic import SyntheticSpec, generate_day
from pipelines.model import store
from research import quality as bq
from research import quality_distill as bqd
from research import quality_models as qm
from research import quality_protocol as qp

SPEC = SyntheticSpec(
    n_users=400,
    n_items=120,
    n_advertisers=10,
    new_users_per_day=150,
    new_items_per_day=10,
    slot_ctr=(0.3, 0.3, 0.3),
    seed=3,
)
TINY = ModelConfig(embed_dim=8, n_heads=2, n_blocks=1, id_buckets=1024, small_buckets=64)
# Plain (not `wide`) candidates keep the run short; the distilled row with a wide base is
# test_distilled_val_stage_reads_only_fit_and_keeps_warm_rows_on_the_base.
GRID = (
    qm.BaseCandidate(model=TINY, max_epochs=1, batch_size=256),
    qm.BaseCandidate(model=TINY, max_epochs=2, batch_size=256, drop_fields=("hour", "weekday")),
)
LCFG = LoraTrainConfig(r=2, alpha=4, min_rows=50, batch_size=128)
CS = ColdStartConfig(r=2, alpha=4, epochs=1, batch_size=32, transfer_batch_size=64)


@pytest.fixture(scope="module")
def frame() -> pd.DataFrame:
    return pd.concat(list(generate_day(SPEC, "2024-01-03", 3000)), ignore_index=True)


@pytest.fixture(scope="module")
def result(frame):
    return bq.run(
        distilled=bqd.make_distilled(CS),
        frame=frame,
        base_grid=GRID,
        lr_grid=(1.0,),
        lora_cfg=LCFG,
        lora_max_epochs=1,
        spread_seeds=1,
    )


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
    assert any(c.model.wide for c in qm.BASE_GRID) and not qm.BASE_GRID[0].model.wide  # defaults first
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
    train, test = bp.temporal_split(frame, bp.TRAIN_FRACTION)
    fit, val = bp.temporal_split(train, 1.0 - bp.VAL_FRACTION)
    cand = qm.BaseCandidate(model=cfg, max_epochs=1, batch_size=256, drop_fields=drop)
    model, _ = qm.train_base(cand, fit, stop_epoch=1)
    store.save_base(model, tmp_path / "fit_base")
    ctx = qp.QualityContext(
        base_dir=tmp_path / "missing",
        fit_base_dir=tmp_path / "fit_base",
        model_cfg=cfg,
        drop_fields=drop,
        train=None if not test_part else train,
        test=None if not test_part else test,
        fit=fit,
        val=val,
        lora_cfg=LCFG,
    )
    return ctx, model, cand


@pytest.mark.parametrize("wide", [False, True])
def test_distilled_val_stage_reads_only_fit_and_keeps_warm_rows_on_the_base(frame, tmp_path, wide):
    cfg = ModelConfig(**{**TINY.__dict__, "wide": wide})
    ctx, model, cand = _ctx(frame, tmp_path, cfg, drop=("hour",), test_part=False)  # train/test/base_dir unusable
    p = bqd.make_distilled(CS)(ctx, stage="val")
    assert p.shape == (len(ctx.val),) and np.isfinite(p).all() and ((p > 0) & (p < 1)).all()
    cold = qp.cold_mask(ctx.fit, ctx.val)
    assert cold.any() and (~cold).any()
    base_p = qm.predict_base(model, cand, ctx.val)
    np.testing.assert_allclose(p[~cold], base_p[~cold], rtol=1e-6)
    assert not np.allclose(p[cold], base_p[cold])  # the student moved away from the base on cold rows


def test_distilled_rejects_an_unknown_stage(frame, tmp_path):
    ctx, _, _ = _ctx(frame, tmp_path, TINY)
    with pytest.raises(ValueError, match="stage"):
        bqd.make_distilled(CS)(ctx, stage="train")


def test_a_distilled_row_that_cannot_be_built_is_reported_and_the_others_stand(frame):
    t = bq._Table.split(frame)
    t.add("lr", np.full(len(t.test), 0.5), 0.5)
    t.add("base", t.y_test * 0.8 + 0.1, 0.6)

    def broken(ctx, stage):
        raise RuntimeError("no student for this base")

    bq._distilled_row(t, broken, ctx=None)
    assert t.out["distilled_error"] == "no student for this base" and "distilled_secs" in t.out
    assert "distilled" not in t.rows
    out = bq._verdict(t)
    assert {k: out[f"distilled_{k}"] for k in ("auc", "auc_cold", "auc_warm", "logloss", "val_auc")} == dict.fromkeys(
        ("auc", "auc_cold", "auc_warm", "logloss", "val_auc")
    )
    assert out["best_model"] == "base" and out["base_minus_lr_auc"] == round(out["base_auc"] - out["lr_auc"], 4)
    assert out["goal_met"] == (out["goal_best_beats_lr_overall"] and out["goal_best_beats_lr_cold"])
    assert list(out["table"]) == ["lr", "base"]


def test_a_distilled_row_of_the_wrong_length_is_an_error(frame):
    t = bq._Table.split(frame)
    with pytest.raises(ValueError, match="pCTRs"):
        bq._distilled_row(t, lambda ctx, stage: np.zeros(3), ctx=None)


def test_our_best_model_is_chosen_on_validation_not_test(frame):
    t = bq._Table.split(frame)
    good = t.y_test * 0.8 + 0.1
    t.add("lr", np.full(len(t.test), 0.5), 0.7)
    t.add("base", good, 0.55)  # the better test AUC, the worse validation AUC
    t.add("lora", np.full(len(t.test), 0.5), 0.6)
    t.add("distilled", good, None)  # no validation AUC: cannot be chosen
    out = bq._verdict(t)
    assert out["best_model"] == "lora" and out["best_model_chosen_on"] == "validation AUC"
    assert out["goal_best_beats_lr_overall"] is False and out["base_minus_lr_auc"] > 0


# ------------------------------------------------------------------------ on MovieLens rows
def test_bench_quality_tiny_run():
    frame = movielens.load().iloc[::25].reset_index(drop=True)  # 4,000 rows spread over the whole period
    grid = (
        qm.BaseCandidate(model=ModelConfig(embed_dim=8, n_blocks=1, id_buckets=1 << 10), max_epochs=2, warmup_steps=2),
    )
    seen = []

    def distilled(ctx, stage):
        seen.append(stage)
        assert isinstance(ctx, qp.QualityContext) and (ctx.base_dir / "weights.safetensors").exists()
        rows = ctx.val if stage == "val" else ctx.test
        return np.full(len(rows), 0.5) if stage == "test" else None

    r = bq.run(
        distilled=distilled,
        frame=frame,
        base_grid=grid,
        lr_grid=(1.0,),
        lora_cfg=LoraTrainConfig(min_rows=50, batch_size=128),
        lora_max_epochs=1,
        spread_seeds=1,
    )
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


def test_cold_mask_marks_the_rows_whose_user_has_no_train_row():
    ts = pd.to_datetime([3, 1, 2, 5, 4], unit="s", utc=True)
    f = pd.DataFrame({"event_ts": ts, "user_id": ["a", "b", "a", "c", "b"]})
    tr, te = bp.temporal_split(f, 0.6)  # the cut: tests/pipelines/bench/test_backtest_protocol.py
    assert qp.cold_mask(tr, te).tolist() == [False, True]  # b (t=4) seen in train, c (t=5) not
