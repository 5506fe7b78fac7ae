"""The backtest's few-shot mode: new users scored after their first K labelled rows (real LR, real PEFT)."""

import numpy as np
import pandas as pd
import pytest

from pipelines.bench import backtest_fewshot as fs, backtest_lr, backtest_protocol
from pipelines.bench.backtest_models import fit_base, score
from pipelines.config import load_pipeline_config
from pipelines.data import movielens
from pipelines.errors import ConfigError
from pipelines.model import features


def _log(users: list[str]) -> pd.DataFrame:
    ts = pd.date_range("2020-01-01", periods=len(users), freq="h", tz="UTC")
    return pd.DataFrame({"event_ts": ts, "user_id": users, "label": [i % 2 for i in range(len(users))]})


def test_split_reveals_each_new_users_first_rows_and_scores_the_rest():
    # 8 rows before the cut (80% of 10), then u1 (seen before) and u9 (new)... on a 20-row log: cut at 16
    users = ["u1", "u2"] * 8 + ["u1", "u9", "u9", "u9"]
    before, revealed, scored = fs.split(_log(users), shots=2)
    assert len(before) == 16
    assert list(revealed["user_id"]) == ["u9", "u9"] and list(scored["user_id"]) == ["u9"]
    assert scored["event_ts"].min() > revealed["event_ts"].max()
    with pytest.raises(ConfigError, match="must be >= 1"):
        fs.split(_log(users), shots=0)


@pytest.mark.slow
def test_movielens_few_shot_rows_match_the_issue_and_the_shipped_delta_moves_only_the_revealed_ids():
    frame = movielens.load()
    before, revealed, scored = fs.split(frame, shots=10)
    assert len(scored) == 15_128  # the issue's reference rows for K = 10
    assert revealed.groupby("user_id").size().max() == 10
    assert not set(revealed["user_id"]) & set(before["user_id"])

    cfg = load_pipeline_config(overrides={"base_training": {"epochs": 1}, "lora": {"epochs": 2}})
    assert cfg.lora.kind == "delta"
    base = fit_base(cfg, before)
    adapted = fs._shipped_adapter(cfg, base, revealed)

    def revealed_ids(rows, table):
        seen = set(features.id_buckets(revealed[table], table, cfg.model))
        return rows[table].map(lambda v: features.id_buckets(pd.Series([v]), table, cfg.model)[0] in seen).to_numpy()

    old = before.tail(2000)
    untouched = ~revealed_ids(old, "user_id") & ~revealed_ids(old, "item_id")
    assert untouched.sum() > 100 and (~untouched).sum() > 100
    np.testing.assert_allclose(score(adapted, cfg, old[untouched]), score(base, cfg, old[untouched]), rtol=1e-6)
    moved = score(adapted, cfg, scored.head(500)) - score(base, cfg, scored.head(500))
    assert np.abs(moved).max() > 1e-4  # the new users' rows did train


@pytest.mark.slow
def test_the_validation_cut_asks_the_same_question_of_the_rows_before_the_test_period():
    frame = movielens.load()
    test_cut = backtest_protocol.temporal_split(frame, backtest_protocol.TRAIN_FRACTION)[1]["event_ts"].min()
    r = fs.run(
        load_pipeline_config(overrides={"base_training": {"epochs": 1}, "lora": {"epochs": 1}}),
        frame,
        shots=10,
        cut="validation",
    )
    before, revealed, scored = fs.split(
        backtest_protocol.temporal_split(frame, backtest_protocol.TRAIN_FRACTION)[0], shots=10
    )
    assert scored["event_ts"].max() <= test_cut and r["rows"] == len(scored) > 1000 and r["cut"] == "validation"
    assert r["adapter_kind"] == "delta" and all(0.5 < r[f"{n}_auc"] < 0.85 for n in fs.COMPARATORS)
    with pytest.raises(ConfigError, match="--cut must be one of"):
        fs.run(load_pipeline_config(), frame, cut="future")


@pytest.mark.slow
def test_the_refitted_lr_reproduces_the_issues_few_shot_reference():
    r = fs.run(load_pipeline_config(overrides={"base_training": {"epochs": 1}, "lora": {"epochs": 1}}), shots=10)
    assert r["rows"] == 15_128 and r["shots"] == 10
    assert r["lr_C"] in backtest_lr.LR_C_GRID
    assert r["lr_few_shot_auc"] > r["lr_static_auc"] + 0.01  # ten rows a user are worth a lot to the LR
    assert all(0.5 < r[f"{n}_auc"] < 0.8 for n in fs.COMPARATORS)
