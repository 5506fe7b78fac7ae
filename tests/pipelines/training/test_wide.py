"""A base whose wide part is a one-hot logistic regression (base_training.wide_l2, training.wide): the
wide tables reach the optimum sklearn's LogisticRegression reaches on the same one-hot columns, the model
starts the deep part exactly at that LR, and the deep part then trains on top of it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.preprocessing import OneHotEncoder

from pipelines.config import BaseTrainConfig, ModelConfig
from pipelines.data.schema import FEATURE_FIELDS
from pipelines.errors import ConfigError
from pipelines.metrics import auc
from pipelines.model.base import CTRModel
from pipelines.training.base_fit import fit_base
from pipelines.training.wide import choose_l2, fit_wide, freeze_wide

CFG = ModelConfig(embed_dim=8, n_heads=2, n_blocks=1, id_buckets=64, small_buckets=8, wide=True)
FIELDS = ("user_id", "item_id", "slot")


def rows(n: int = 3000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Tokens (every field in range, no hashing) and labels drawn from a true LR over user, item and slot."""
    rng = np.random.default_rng(seed)
    x = np.stack(
        [
            rng.integers(0, CFG.id_buckets if f in ("user_id", "item_id") else CFG.small_buckets, n)
            for f in FEATURE_FIELDS
        ],
        axis=1,
    )
    w = {f: rng.normal(0, 1, CFG.id_buckets) for f in FIELDS}
    z = -0.5 + sum(w[f][x[:, FEATURE_FIELDS.index(f)] % CFG.id_buckets] for f in FIELDS)
    return x, (rng.random(n) < 1 / (1 + np.exp(-z))).astype(np.float32)


def sklearn_lr(x: np.ndarray, y: np.ndarray, C: float, fields=FIELDS):
    cols = x[:, [FEATURE_FIELDS.index(f) for f in fields]]
    enc = OneHotEncoder(handle_unknown="ignore").fit(cols)
    lr = LogisticRegression(C=C, max_iter=5000, tol=1e-10).fit(enc.transform(cols), y)
    return lambda xx: lr.decision_function(enc.transform(xx[:, [FEATURE_FIELDS.index(f) for f in fields]]))


def wide_logit(model: CTRModel, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model.wide_logit(torch.as_tensor(x)).numpy()


@pytest.mark.parametrize("C", [0.3, 3.0])
def test_the_wide_tables_reach_the_optimum_of_sklearns_l2_logistic_regression(C):
    x, y = rows()
    model = CTRModel(CFG)
    report = fit_wide(model, x, y, l2=1.0 / C, fields=FIELDS)
    want = sklearn_lr(x, y, C)(x)
    np.testing.assert_allclose(wide_logit(model, x), want, atol=2e-3)
    assert report["iterations"] > 0
    unread = [f for f in FEATURE_FIELDS if f not in FIELDS]
    assert all(float(model.wide[f].weight.abs().sum()) == 0 for f in unread)  # fields the LR does not read


def test_a_stronger_penalty_shrinks_the_weights():
    x, y = rows()
    loose, tight = CTRModel(CFG), CTRModel(CFG)
    fit_wide(loose, x, y, l2=0.1, fields=FIELDS)
    fit_wide(tight, x, y, l2=100.0, fields=FIELDS)
    assert np.std(wide_logit(tight, x)) < 0.5 * np.std(wide_logit(loose, x))


def test_after_freezing_the_model_scores_exactly_as_the_lr_and_only_the_deep_part_trains():
    x, y = rows()
    model = CTRModel(CFG)
    fit_wide(model, x, y, l2=3.0, fields=FIELDS)
    freeze_wide(model)
    with torch.no_grad():
        np.testing.assert_allclose(model(torch.as_tensor(x)).numpy(), wide_logit(model, x), atol=1e-6)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and not any(n.startswith("wide.") for n in trainable)


def test_fit_base_fits_the_lr_then_the_deep_part_on_top_and_epochs_0_keeps_the_lr_alone():
    x, y = rows()
    bt = BaseTrainConfig(epochs=2, batch_size=256, lr=3e-3, wide_l2=3.0, wide_fields=FIELDS, warmup_steps=2)
    both, alone = CTRModel(CFG), CTRModel(CFG)
    out = fit_base(both, x, y, bt)
    fit_base(alone, x, y, dataclasses.replace(bt, epochs=0))
    np.testing.assert_allclose(wide_logit(both, x), wide_logit(alone, x), atol=1e-6)  # the LR stays frozen
    with torch.no_grad():
        deep = both(torch.as_tensor(x)).numpy() - wide_logit(both, x)
        np.testing.assert_allclose(alone(torch.as_tensor(x)).numpy(), wide_logit(alone, x), atol=1e-6)
    assert np.abs(deep).max() > 1e-4 and len(out["history"]) == 2 and out["wide"]["iterations"] > 0
    assert all(p.requires_grad for p in both.parameters())  # the module is handed back as any fresh fit


def test_a_wide_lr_needs_a_wide_term_and_known_fields():
    x, y = rows(200)
    with pytest.raises(ConfigError, match="model.wide: true"):
        fit_wide(CTRModel(dataclasses.replace(CFG, wide=False)), x, y, l2=1.0)
    with pytest.raises(ConfigError, match=r"wide_fields \['price'\]"):
        fit_wide(CTRModel(CFG), x, y, l2=1.0, fields=("user_id", "price"))


def test_epochs_0_is_only_a_base_with_a_wide_lr():
    with pytest.raises(ConfigError, match="epochs >= 1"):
        BaseTrainConfig(epochs=0)
    assert BaseTrainConfig(epochs=0, wide_l2=1.0).epochs == 0
    with pytest.raises(ConfigError, match="wide_l2 must be >= 0"):
        BaseTrainConfig(wide_l2=-1.0)


def test_with_a_grid_the_l2_is_the_one_whose_lr_on_the_oldest_rows_ranks_the_newest_best():
    """As the backtest's lr_static chooses its C: fit on the oldest 90%, AUC on the newest 10%."""
    x, y = rows(2000)
    grid = (300.0, 3.0, 0.01)
    model = CTRModel(CFG)
    chosen, by_l2, _ = choose_l2(model, x, y, grid, 0.1, FIELDS)
    held = wide_logit(model, x)  # the model is left holding the chosen fit: the start of the fit on every row
    for l2 in grid:  # each score is that L2's LR fitted on the oldest rows only, ranking the newest
        older = CTRModel(CFG)
        fit_wide(older, x[:1800], y[:1800], l2, FIELDS)
        assert by_l2[str(l2)] == pytest.approx(auc(y[1800:], wide_logit(older, x[1800:])), abs=1e-6)
    assert by_l2[str(chosen)] == max(by_l2.values()) and len(set(by_l2.values())) == 3
    assert chosen != 300.0  # a true LR of 2,000 rows over 64 ids: a heavy penalty ranks worst
    older = CTRModel(CFG)
    fit_wide(older, x[:1800], y[:1800], chosen, FIELDS)
    np.testing.assert_allclose(held, wide_logit(older, x), atol=5e-3)


def test_fit_base_with_a_grid_refits_the_chosen_l2_on_every_row_and_reports_the_choice():
    x, y = rows(2000)
    bt = BaseTrainConfig(epochs=0, wide_l2=1.0, wide_l2_grid=(300.0, 3.0, 0.01), wide_fields=FIELDS)
    out = fit_base(CTRModel(CFG), x, y, bt)
    by_l2 = out["wide"]["auc_by_l2"]
    assert set(by_l2) == {"300.0", "3.0", "0.01"} and by_l2[str(out["wide"]["l2"])] == max(by_l2.values())
    chosen, fixed = CTRModel(CFG), CTRModel(CFG)
    fit_base(chosen, x, y, bt)
    fit_base(fixed, x, y, dataclasses.replace(bt, wide_l2=out["wide"]["l2"], wide_l2_grid=()))
    np.testing.assert_allclose(wide_logit(chosen, x), wide_logit(fixed, x), atol=5e-3)  # one optimum, two starts


def test_an_l2_grid_needs_positive_values_a_wide_lr_and_newest_rows_of_both_labels():
    with pytest.raises(ConfigError, match="wide_l2_grid"):
        BaseTrainConfig(wide_l2=1.0, wide_l2_grid=(1.0, 0.0))
    with pytest.raises(ConfigError, match="wide_l2_grid"):
        BaseTrainConfig(wide_l2=0.0, wide_l2_grid=(1.0,))
    x, y = rows(200)
    with pytest.raises(ConfigError, match="no newest 10% with both labels"):
        choose_l2(CTRModel(CFG), x, np.r_[y[:180], np.zeros(20, np.float32)], (1.0, 3.0), 0.1, FIELDS)
