"""training.orthogonality: the low-rank penalty equals its dense definition, saved adapters read back as
trained, and training with it makes a real PEFT adapter less aligned with its sibling."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipelines.config import LoraTrainConfig
from pipelines.errors import PipelineError
from pipelines.evaluation.interference import adapter_interference
from pipelines.model import adapters
from pipelines.bench import serving_demo as demo
from pipelines.training import orthogonality as ortho
from pipelines.training.loop import LoopSettings, train
from tests.pipelines.training import helpers

QV_EMB = LoraTrainConfig(
    r=4, alpha=8, target_modules=("q_proj", "v_proj", "embeddings"), rank_pattern={"blocks.0.v_proj": 2}
)


def _dense(model, adapter: str = "default") -> dict[str, torch.Tensor]:
    """Every wrapped module's update in its weight's shape, as PEFT itself computes it."""
    out = {}
    for name, m in model.named_modules():
        if hasattr(m, "get_delta_weight") and (adapter in m.lora_A or adapter in m.lora_embedding_A):
            out[name.removeprefix("base_model.model.")] = m.get_delta_weight(adapter).detach()
    return out


def _weight_shaped(name: str, dw: torch.Tensor, model) -> torch.Tensor:
    shape = model.get_submodule(f"base_model.model.{name}").get_base_layer().weight.shape
    return dw if dw.shape == shape else dw.T


@pytest.fixture(scope="module")
def pair():
    base = helpers.base(0).requires_grad_(False)
    return (demo.random_adapter(base, seed=1, lora_cfg=QV_EMB), demo.random_adapter(base, seed=2, lora_cfg=QV_EMB))


def test_penalty_and_cosine_equal_their_dense_definitions(pair):
    a, b = pair
    da = {k: _weight_shaped(k, v, a) for k, v in _dense(a).items()}
    db = {k: _weight_shaped(k, v, b) for k, v in _dense(b).items()}
    assert (
        any(k.startswith("embeddings.") for k in da)
        and a.get_submodule("base_model.model.blocks.0.v_proj").r["default"] == 2
    )
    dense = sum(torch.linalg.matrix_norm(da[m].T @ db[m]) for m in da)
    got = ortho.penalty(ortho.live_factors(a), {"b": ortho.live_factors(b)})
    torch.testing.assert_close(got.detach(), dense, rtol=1e-4, atol=1e-7)
    cos = max(
        abs(float((da[m] * db[m]).sum())) / float(da[m].norm() * db[m].norm())
        for m in da
        if da[m].norm() > 0 and db[m].norm() > 0
    )
    assert ortho.max_abs_cos(ortho.live_factors(a), {"b": ortho.live_factors(b)}) == pytest.approx(cos, rel=1e-5)
    norm = float(torch.sqrt(sum((da[m] ** 2).sum() for m in da)))
    assert ortho.update_norm(ortho.live_factors(a)) == pytest.approx(norm, rel=1e-5)


def test_saved_adapters_read_back_with_their_per_layer_scales(pair, tmp_path):
    a, b = pair
    for name, model in (("a", a), ("b", b)):
        adapters.save(model, tmp_path / name)
    live, saved = ortho.live_factors(a), ortho.saved_factors(tmp_path / "a")
    assert set(saved) == set(live)
    for m in live:
        torch.testing.assert_close(saved[m][0] @ saved[m][1], (live[m][0] @ live[m][1]).detach(), rtol=1e-5, atol=1e-7)
    # the same |cos| as the evaluation's interference measurement of the saved files
    measured = adapter_interference({"a": tmp_path / "a", "b": tmp_path / "b"})["max_abs_cos"]
    assert ortho.max_abs_cos(saved, {"b": ortho.saved_factors(tmp_path / "b")}) == pytest.approx(measured, rel=1e-5)


def test_a_fresh_adapter_has_a_zero_penalty_with_finite_gradients(pair):
    _, sibling = pair
    fresh = adapters.attach(helpers.base(0), LoraTrainConfig(r=4, alpha=8))  # B = 0: no update yet
    reg = ortho.Regularizer(0.5, {"s": ortho.live_factors(sibling)})
    loss = reg(fresh)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(0.0, abs=1e-8)
    grads = [p.grad for n, p in fresh.named_parameters() if "lora_" in n and p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert reg.report(fresh)["max_abs_cos"] is None  # no direction to compare


def test_training_with_the_penalty_moves_an_adapter_away_from_its_sibling():
    x, y = helpers.rows("2024-01-02", 3_000)
    lc = LoraTrainConfig(r=4, alpha=8)
    settings = LoopSettings(epochs=2, batch_size=128, lr=5e-3, weight_decay=0.0, warmup_steps=5, seed=3)
    sibling = adapters.attach(helpers.base(0), lc)
    train(sibling, x, y, settings)  # a sibling trained on the same rows: strongly aligned
    siblings = {"sib": ortho.live_factors(sibling)}

    def fit(lam: float):
        model = adapters.attach(helpers.base(0), lc)
        reg = ortho.Regularizer(lam, siblings) if lam else None
        history = train(model, x, y, dataclasses.replace(settings, seed=4), regularizer=reg)
        return ortho.Regularizer(1.0, siblings).report(model), history

    plain, _ = fit(0.0)
    penalised, history = fit(1.0)
    assert plain["max_abs_cos"] > 0.3, plain
    assert penalised["max_abs_cos"] < plain["max_abs_cos"] / 2, (plain, penalised)
    assert penalised["penalty"] < plain["penalty"] / 4
    assert all(torch.isfinite(torch.tensor(h["train_loss"])) for h in history)


def test_mismatched_shapes_and_unreadable_adapters_are_typed_errors(pair, tmp_path):
    a, _ = pair
    live = ortho.live_factors(a)
    m = next(iter(live))
    wrong = {m: (torch.zeros(3, 1), torch.zeros(1, 5))}
    with pytest.raises(PipelineError, match=f"module {m} updates"):
        ortho.penalty(live, {"other": wrong})
    with pytest.raises(PipelineError, match="cannot read the adapter"):
        ortho.saved_factors(tmp_path / "missing")
