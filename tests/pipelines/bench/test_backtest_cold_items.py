"""`backtest --cold-items K`: every scored row scored by a base fitted without its item (real bases, real data)."""

import hashlib
import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import yaml

from pipelines.bench import backtest, backtest_scores
from pipelines.bench import backtest_cold_items as ci
from pipelines.bench.backtest_protocol import build
from pipelines.config import load_pipeline_config
from pipelines.data import movielens
from pipelines.errors import ConfigError
from pipelines.metrics import auc


def _log() -> pd.DataFrame:
    """40 rows over 4 days, items i0..i9 (i8 and i9 first seen on day 4), users u0..u4."""
    ts = pd.date_range("2024-01-01 08:00", periods=40, freq="130min", tz="UTC")
    items = [f"i{k % 8}" for k in range(30)] + [f"i{k % 10}" for k in range(10)]
    return pd.DataFrame(
        {
            "event_ts": ts,
            "user_id": [f"u{k % 5}" for k in range(40)],
            "item_id": items,
            "slot": "morning",
            "label": [k % 2 for k in range(40)],
        }
    )


def test_an_items_fold_is_a_hash_of_its_id_the_same_on_every_call():
    ids = pd.Series([str(i) for i in range(1000)])
    folds = ci.fold_of(ids, 5)
    assert folds.tolist() == ci.fold_of(ids, 5).tolist() and set(folds) == {0, 1, 2, 3, 4}
    assert folds[7] == int(hashlib.sha256(b"7").hexdigest()[:15], 16) % 5
    assert all(150 < (folds == k).sum() < 250 for k in range(5))  # about a fifth each
    with pytest.raises(ConfigError, match="folds must be >= 2, got 1"):
        ci.fold_of(ids, 1)


def test_each_fold_trains_on_the_history_without_its_items_and_every_scored_row_is_scored_once():
    bt = build(_log(), "2024-01-04")
    history, scored = bt.history(bt.days[0]), bt.frame.iloc[bt.first : bt.last]
    parts = ci.split(bt, 3)
    masks = np.stack([m for _, m in parts])
    assert (masks.sum(axis=0) == 1).all()  # each scored row in exactly one fold
    for rows, mask in parts:
        held = set(scored["item_id"][mask])
        assert not set(rows["item_id"]) & held
        # nothing else is dropped: the history rows of every other item stay
        assert len(rows) == int((~history["item_id"].isin(held)).sum())
        assert rows["event_ts"].max() < scored["event_ts"].min()


@pytest.fixture(scope="module")
def frame():
    return movielens.load()


@pytest.mark.slow
def test_a_label_only_the_item_id_explains_is_learnt_in_the_replay_and_unknowable_without_the_item(frame):
    """The protocol hides the item: clicks set by the item's id alone are read off a base that saw the item
    (the replay's static base) and are a coin toss for the same base fitted without it."""
    parity = frame["item_id"].map(lambda i: int(hashlib.sha256(i.encode()).hexdigest(), 16) % 2).astype("int8")
    relabelled = frame.assign(label=parity)
    cfg = load_pipeline_config(overrides={"base_training": {"epochs": 2}})
    seen = backtest.run(cfg, relabelled, max_days=2, names=("static",), parallel=False)
    hidden = ci.run(cfg, relabelled, folds=2, max_days=2)
    assert seen["rows"] == hidden["rows"] and seen["new_item_rows"] == hidden["new_item_rows"]
    assert seen["static_auc"] > 0.8, seen["static_auc"]
    assert abs(hidden["static_auc"] - 0.5) < 0.1, hidden["static_auc"]


@pytest.mark.slow
def test_the_cli_writes_a_scores_file_that_pairs_with_its_own_protocol_only(frame, tmp_path):
    over = {"base_training": {"epochs": 1}}
    cmd = [
        sys.executable,
        "-m",
        "pipelines",
        "backtest",
        "--cold-items",
        "2",
        "--days",
        "2",
        "--json",
        "--base-cache",
        str(tmp_path / "bases"),
    ]
    first = subprocess.run(
        [*cmd, "--config", _config(tmp_path, over), "--scores", str(tmp_path / "a.parquet")],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    r = json.loads(first.stdout)
    assert r["protocol"] == "cold_items" and r["folds"] == 2 and r["days"] == 2
    assert sum(f["scored_rows"] for f in r["per_fold"]) == r["rows"] == r["warm_rows"] + r["cold_rows"]
    assert all(f["cpu_s"] > 0 and f["base_loaded_from"] is None for f in r["per_fold"])
    rows, meta = backtest_scores.read(r["scores"])
    assert meta == {
        "model_family": "feature_transformer",
        "from": r["from"],
        "to": r["to"],
        "protocol": "cold_items",
        "folds": 2,
    }
    assert round(auc(rows["label"].to_numpy(), rows["score_static"].to_numpy()), 4) == r["static_auc"]

    # the same folds again: both bases come from the cache, the scores are the same
    again = json.loads(
        subprocess.run(
            [*cmd, "--config", _config(tmp_path, over), "--scores", str(tmp_path / "b.parquet")],
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        ).stdout
    )
    assert all(f["base_loaded_from"] for f in again["per_fold"]) and again["static_auc"] == r["static_auc"]
    same = backtest_scores.compare(str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet"))
    assert same["protocol"] == "cold_items (2 folds)" and same["parts"]["all"]["diff"] == 0.0

    # a replay's file scores the same rows, but its models saw the items: pairing them is refused
    backtest.run(
        load_pipeline_config(overrides=over),
        frame,
        max_days=2,
        names=("static",),
        parallel=False,
        scores=str(tmp_path / "replay.parquet"),
    )
    with pytest.raises(ConfigError, match="replay protocol and .*cold_items"):
        backtest_scores.compare(str(tmp_path / "replay.parquet"), str(tmp_path / "a.parquet"))


def test_a_fold_count_below_two_is_a_usage_error_before_anything_is_fitted(frame):
    with pytest.raises(ConfigError, match="folds must be >= 2"):
        ci.run(load_pipeline_config(), frame, folds=1)


def _config(tmp_path, over: dict) -> str:
    with open("configs/pipeline.yaml") as f:
        cfg = yaml.safe_load(f)
    cfg["base_training"].update(over["base_training"])
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.mark.slow
def test_a_fold_without_scored_items_fits_no_base(frame):
    """More folds than scored items: a fold with nothing to score is reported empty and fits no base."""
    day = frame["event_ts"].dt.strftime("%Y-%m-%d")
    first = frame[day == "1998-03-07"]
    two = first["item_id"].value_counts().index[:2]
    small = pd.concat([frame[day < "1998-03-07"], first[first["item_id"].isin(two)]])
    r = ci.run(
        load_pipeline_config(overrides={"base_training": {"epochs": 1}}),
        small,
        folds=8,
        day_from="1998-03-07",
        max_days=1,
    )
    assert len(r["per_fold"]) == 8 and r["rows"] == int(first["item_id"].isin(two).sum())
    scoring = [f for f in r["per_fold"] if f["scored_rows"]]
    assert 1 <= len(scoring) <= 2 and sum(f["scored_rows"] for f in scoring) == r["rows"]
    assert all(f["cpu_s"] > 0 for f in scoring)
    assert all(
        f["auc"] is None and f["cpu_s"] == 0.0 and f["items"] == 0 for f in r["per_fold"] if not f["scored_rows"]
    )
