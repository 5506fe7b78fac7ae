"""The LR comparators of the backtest (issue 31): lr_static is the LR fitted at the cut, lr_daily refits it,
lr_delta adds per-id deltas fitted on the trailing week with the frozen LR's logit as offset, at the
optimum of their L2-penalised log-loss. Real MovieLens, real scikit-learn."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from pipelines.bench import backtest_lr
from pipelines.bench.backtest_protocol import build
from pipelines.data import movielens


@pytest.fixture(scope="module")
def bt():
    return build(movielens.load(), max_days=3)


def replay(models, bt):
    return {m.name: np.concatenate([m.predict_day(bt, d) for d in bt.days]) for m in models}


def test_the_static_lr_is_the_daily_lr_of_the_first_day_and_never_moves_after(bt):
    static, daily = backtest_lr.LrStatic(), backtest_lr.LrDaily()
    p = replay([static, daily], bt)
    first = bt.days[0].rows
    np.testing.assert_allclose(p["lr_static"][:first], p["lr_daily"][:first])
    assert not np.allclose(p["lr_static"][first:], p["lr_daily"][first:])  # the daily one refits on day 1
    assert static.C == daily.C and static.cpu_s < daily.cpu_s


def test_the_delta_is_the_optimum_of_its_penalised_log_loss():
    rng = np.random.default_rng(0)
    window = pd.DataFrame(
        {
            "user_id": rng.choice(["u1", "u2", "u3"], 400),
            "item_id": rng.choice(["a", "b"], 400),
            "slot": "feed",
            "label": rng.integers(0, 2, 400),
        }
    )
    offset = rng.normal(0, 0.5, 400)
    index, d = backtest_lr.fit_delta(window, offset, l2=2.0)
    assert set(index) == {("user", u) for u in ("u1", "u2", "u3")} | {("item", i) for i in ("a", "b")}
    x = backtest_lr._design(window, index).toarray()
    p = 1 / (1 + np.exp(-(offset + x @ d)))
    np.testing.assert_allclose(x.T @ (p - window["label"].to_numpy()) + 2.0 * d, 0.0, atol=1e-3)  # gradient 0
    _, tight = backtest_lr.fit_delta(window, offset, l2=1e6)
    assert np.abs(tight).max() < 1e-3 < np.abs(d).max()  # the anchor holds every delta at zero


def test_an_anchored_delta_scores_as_the_static_lr_and_a_free_one_moves_seen_users(bt):
    static = backtest_lr.LrStatic()
    anchored = backtest_lr.LrDelta(l2=1e9)
    free = backtest_lr.LrDelta()
    p = replay([static, anchored], bt)
    np.testing.assert_allclose(p["lr_delta"], p["lr_static"], atol=1e-6)
    moved = replay([free], bt)["lr_delta"]
    warm = bt.warm[bt.first : bt.last]
    assert not np.allclose(moved[warm], p["lr_static"][warm], atol=1e-3)
    assert free.info()["deltas_mean"] > 100 and free.info()["window_days"] == backtest_lr.DELTA_WINDOW_DAYS
