"""The loop's per-epoch validation, early stopping with the best weights restored, divergence guard,
progress bar and determinism with every new feature switched on."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from pipelines.config import LoraTrainConfig
from pipelines.model import adapters
from pipelines.model.inference import ArraySource, evaluate
from pipelines.training.loop import LoopSettings, fit, seed_everything
from tests.pipelines.training.helpers import base, rows


@pytest.fixture(scope="module")
def data():
    return rows("2024-01-03", 600)


def weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def adversarial_val(x, y):
    """The training rows with flipped labels: the better the model fits, the worse its val logloss,
    so the best epoch comes early and the later ones only get worse."""
    return x[:300], (1.0 - y[:300]).astype(np.float32)


def test_early_stopping_stops_after_patience_and_restores_the_best_weights(data):
    x, y = data
    val = adversarial_val(x, y)
    model = base()
    last = {}
    res = fit(
        model,
        (x, y),
        LoopSettings(10, 64, 1e-2, 0.0, 2, 7, patience=2),
        val=val,
        on_epoch=lambda m: last.update(weights(model)),
    )
    hist = res["history"]
    lls = [h["val_logloss"] for h in hist]
    best = int(np.argmin(lls)) + 1
    assert res["stopped_early"] and not res["diverged"]
    assert res["best_epoch"] == best and res["epochs_run"] == best + 2 == len(hist) < 10
    assert all(ll >= lls[best - 1] for ll in lls[best:])
    # the restored model is the best epoch's: its val logloss is exactly that epoch's
    assert evaluate(model, ArraySource(*val))["val_logloss"] == lls[best - 1] == res["best_val_logloss"]
    assert any(not torch.equal(last[k], v) for k, v in weights(model).items())  # not the last epoch's
    assert not model.training


def test_patience_zero_trains_every_epoch_and_keeps_the_last_weights(data):
    x, y = data
    model = base()
    last = {}
    res = fit(
        model,
        (x, y),
        LoopSettings(4, 64, 1e-2, 0.0, 2, 7, patience=0),
        val=adversarial_val(x, y),
        on_epoch=lambda m: last.update(weights(model)),
    )
    assert res["epochs_run"] == 4 and res["best_epoch"] is None and not res["stopped_early"]
    assert all(torch.equal(last[k], v) for k, v in weights(model).items())
    assert {"val_auc", "val_logloss", "train_loss", "samples_per_s", "lr"} <= set(res["history"][-1])


def test_a_non_finite_loss_stops_training(data):
    x, y = data
    model = base()
    with torch.no_grad():
        model.head.bias.fill_(float("nan"))
    res = fit(model, (x, y), LoopSettings(5, 64, 1e-2, 0.0, 2, 7, patience=2), val=(x[:100], y[:100]))
    assert res["diverged"] and res["epochs_run"] == 1 and not np.isfinite(res["history"][0]["train_loss"])


def test_progress_bar_does_not_change_the_result(data, capsys):
    x, y = data
    a, b = base(), base()
    fit(a, (x, y), LoopSettings(1, 64, 1e-2, 0.0, 2, 7))
    fit(b, (x, y), LoopSettings(1, 64, 1e-2, 0.0, 2, 7), progress=True, desc="bar-test")
    assert "bar-test 1/1" in capsys.readouterr().err
    assert all(torch.equal(v, weights(b)[k]) for k, v in weights(a).items())


def test_lora_training_with_every_feature_is_deterministic_for_a_seed(data):
    x, y = data
    val = rows("2024-01-04", 200)
    lcfg = LoraTrainConfig(
        r=4, alpha=8, dropout=0.1, target_modules=("q_proj", "v_proj", "embeddings"), train_layernorm_bias=True
    )
    init = base()
    runs = []
    for seed in (7, 7, 8):
        seed_everything(seed)
        model = adapters.attach(copy.deepcopy(init), lcfg)
        res = fit(model, (x, y), LoopSettings(3, 32, 5e-3, 0.01, 2, seed, patience=1), val=val)
        runs.append((weights(model), [h["val_logloss"] for h in res["history"]]))
    (a, ha), (b, hb), (c, _) = runs
    assert ha == hb
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_the_start_competes_as_epoch_zero_and_is_kept_when_no_epoch_beats_it(data):
    """An adapter on labels opposite to its val rows gets worse every epoch: with `start_is_candidate`
    it ends as it started (LoRA B zero: the base's scores), without it the least bad epoch is kept."""
    x, y = data
    val = adversarial_val(x, y)
    init = base()
    start_ll = evaluate(init, ArraySource(*val))["val_logloss"]
    lcfg = LoraTrainConfig(r=4, alpha=8, target_modules=("q_proj", "v_proj"))
    ends = {}
    for keep in (True, False):
        seed_everything(7)
        model = adapters.attach(copy.deepcopy(init), lcfg)
        before = weights(model)
        res = fit(model, (x, y), LoopSettings(3, 64, 1e-2, 0.0, 2, 7, patience=2, start_is_candidate=keep), val=val)
        assert all(h["val_logloss"] > start_ll for h in res["history"])  # every epoch is worse than the start
        ends[keep] = (
            res,
            all(torch.equal(before[k], v) for k, v in weights(model).items()),
            evaluate(model, ArraySource(*val))["val_logloss"],
        )
    (kept, kept_same, kept_ll), (least, least_same, least_ll) = ends[True], ends[False]
    assert kept["best_epoch"] == 0 and kept["best_val_logloss"] == start_ll and kept_same and kept_ll == start_ll
    assert least["best_epoch"] >= 1 and not least_same and least_ll > start_ll
