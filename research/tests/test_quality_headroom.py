"""The headroom probe: its features are causal and label-free where they claim to be, the few-shot
reference reveals only what it says, and the run agrees with `research.quality`'s own LR (the backtest's)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from pipelines.bench import backtest_lr as lr
from pipelines.bench import backtest_protocol as bp
from pipelines.data.synthetic import SyntheticSpec, generate_day
from research import quality_headroom as hr
from research import quality_protocol as qp

SPEC = SyntheticSpec(
    n_users=300,
    n_items=80,
    n_advertisers=10,
    new_users_per_day=120,
    new_items_per_day=8,
    slot_ctr=(0.3, 0.3, 0.3),
    seed=5,
)


@pytest.fixture(scope="module")
def frame() -> pd.DataFrame:
    f = pd.concat(list(generate_day(SPEC, "2024-01-03", 3000)), ignore_index=True)
    rng = np.random.default_rng(0)
    # The side-info columns MovieLens supplies through hr.side_info().
    f["genres"] = f["category"].astype(str) + np.where(rng.random(len(f)) < 0.5, " Drama", "")
    f["release_bucket"] = rng.choice(["1975", "1990", "1995"], len(f))
    f["zip1"] = rng.choice(list("0123456789"), len(f))
    return f.sort_values("event_ts", kind="stable").reset_index(drop=True)


def test_counters_count_only_earlier_rows_and_read_no_label_of_the_frame():
    f = pd.DataFrame(
        {"user_id": ["u", "v", "u", "u", "v"], "item_id": ["a", "a", "b", "a", "c"], "label": [1, 0, 1, 0, 1]}
    )
    train = pd.DataFrame({"item_id": ["a", "a", "b"], "label": [1, 1, 0]})
    out = hr.add_counters(f, train)
    # impressions before each row: u: 0, 1, 2 -> log2 buckets 0, 1, 1; item a: 0, 1, 2
    assert out["user_seen"].tolist() == ["0", "0", "1", "1", "1"]
    assert out["item_seen"].tolist() == ["0", "1", "0", "1", "0"]
    rate = 2 / 3
    a = (2 + hr.TASTE_PRIOR_ROWS * rate) / (2 + hr.TASTE_PRIOR_ROWS)
    b = (0 + hr.TASTE_PRIOR_ROWS * rate) / (1 + hr.TASTE_PRIOR_ROWS)
    assert out["taste"].tolist() == pytest.approx([rate, rate, a, (a + b) / 2, a])
    flipped = f.assign(label=1 - f["label"])
    pd.testing.assert_frame_equal(hr.add_counters(flipped, train).drop(columns="label"), out.drop(columns="label"))
    # A later row never changes an earlier row's features.
    changed = f.copy()
    changed.loc[4, ["user_id", "item_id"]] = ["u", "a"]
    pd.testing.assert_frame_equal(hr.add_counters(changed, train).iloc[:4], out.iloc[:4])


def test_out_of_fold_encoding_never_reads_the_row_own_label(frame):
    src = frame.head(1000)
    enc = hr._oof_encode(src)
    assert list(enc.index) == list(src.index)
    flipped = src.copy()
    flipped.loc[flipped.index[7], "label"] = 1 - flipped.loc[flipped.index[7], "label"]
    pd.testing.assert_series_equal(hr._oof_encode(flipped).iloc[7], enc.iloc[7])


def test_crosses_and_recency_weights():
    f = pd.DataFrame(
        {
            "gender": ["M", "F"],
            "item_id": ["1", "2"],
            "age_bucket": ["18-24", "56+"],
            "category": ["Drama", "Action"],
            "occupation": ["x", "y"],
            "event_ts": pd.to_datetime(["2024-01-01", "2024-05-01"], utc=True),
        }
    )
    out = hr.add_crosses(f)
    assert out["gender*item_id"].tolist() == ["M|1", "F|2"]
    w = hr.recency_weights(f)
    assert w[1] == 1.0 and w[0] == pytest.approx(np.exp(-121 / hr.DECAY_DAYS))


def test_few_shot_reveals_the_first_k_rows_of_cold_users_only(frame):
    train, test = bp.temporal_split(frame, bp.TRAIN_FRACTION)
    out = hr.few_shot(train, test, C=1.0, k=3)
    cold_users = set(test["user_id"]) - set(train["user_id"])
    expected = sum(min(3, n) for n in test[test["user_id"].isin(cold_users)].groupby("user_id").size())
    assert out["support_rows"] == expected and out["query_rows"] == len(test) - expected
    for key in ("lr_static", "lr_with_support"):
        assert 0.0 <= out[key]["auc"] <= 1.0


def test_run_reports_every_variant_against_bench_quality_own_lr(frame):
    out = hr.run(frame=frame, k_shot=3, grid=(0.3, 1.0))
    json.dumps(out)
    assert set(out["rows"]) == {
        "lr_one_hot",
        "lr_side_info",
        "lr_crosses",
        "lr_behaviour_counters",
        "lr_recency_weighted",
        "lr_everything",
        "gbdt_target_encoded",
    }
    ref = out["rows"]["lr_one_hot"]
    assert ref["delta_auc"] == 0.0
    # The reference row is exactly bench quality's LR row on the same split and grid.
    train, test = bp.temporal_split(frame, bp.TRAIN_FRACTION)
    fit, val = bp.temporal_split(train, 1.0 - bp.VAL_FRACTION)
    C, _ = lr.tune_lr(fit, val, (0.3, 1.0))
    assert ref["C"] == C
    expected = qp.scores(test["label"].to_numpy(), lr.predict_lr(lr.fit_lr(train, C), test), qp.cold_mask(train, test))
    assert {k: ref[k] for k in expected} == expected
    assert out["max_delta_auc"] == max(r["delta_auc"] for r in out["rows"].values())
    assert out["chosen_on_validation"] in out["rows"]
