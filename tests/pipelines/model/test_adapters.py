"""LoRA on the real CTR model with real PEFT, the training loop, and the temporal split."""

from __future__ import annotations

import copy

import numpy as np
import pandas as pd
import pytest
import torch
from peft.tuners.lora import LoraLayer

from pipelines.config import LoraTrainConfig, ModelConfig
from pipelines.data.synthetic import SyntheticSpec, generate_day
from pipelines.model import adapters, features, store
from pipelines.model.base import CTRModel, fingerprint
from pipelines.model.inference import predict
from pipelines.training.loop import LoopSettings, lr_at, train

CFG = ModelConfig(embed_dim=16, n_heads=2, n_blocks=1, id_buckets=1024)
LCFG = LoraTrainConfig(r=4, alpha=8, target_modules=("q_proj", "v_proj"))
SPEC = SyntheticSpec(n_users=2_000, n_items=300, n_advertisers=30, new_users_per_day=100, new_items_per_day=10, seed=7)


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray]:
    frame = pd.concat(list(generate_day(SPEC, "2024-01-03", 256)), ignore_index=True)
    return features.encode(frame, CFG), features.labels(frame)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> str:
    """A stored base model with non-trivial weights (the full model trained one short epoch)."""
    torch.manual_seed(0)
    m = CTRModel(CFG)
    frame = pd.concat(list(generate_day(SPEC, "2024-01-02", 256)), ignore_index=True)
    train(
        m,
        features.encode(frame, CFG),
        features.labels(frame),
        LoopSettings(epochs=1, batch_size=64, lr=1e-2, weight_decay=0.0, warmup_steps=1, seed=1),
    )
    d = tmp_path_factory.mktemp("base")
    store.save_base(m, d)
    return str(d)


def out(model, x: np.ndarray) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(torch.from_numpy(x))


def settings(epochs=1, batch_size=64, lr=5e-2, seed=7, weight_decay=0.0, warmup_steps=1) -> LoopSettings:
    return LoopSettings(
        epochs=epochs, batch_size=batch_size, lr=lr, weight_decay=weight_decay, warmup_steps=warmup_steps, seed=seed
    )


def snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


# ----------------------------------------------------------------------------- (a) identity at init / disable
def test_fresh_adapter_is_the_identity_and_disable_adapter_restores_base(base_dir, data):
    x, y = data
    reference = out(store.load_base(base_dir), x)

    model = adapters.attach(store.load_base(base_dir), LCFG)
    # B is initialised to zero: the wrapped model computes exactly what the base computes
    assert all(torch.count_nonzero(p) == 0 for n, p in model.named_parameters() if "lora_B" in n)
    assert torch.equal(out(model, x), reference)

    train(model, x, y, settings(epochs=2))
    trained = out(model, x)
    assert not torch.equal(trained, reference)  # the adapter learned something
    with model.disable_adapter():
        assert torch.equal(out(model, x), reference)
    # leaving the context re-enables the adapter
    assert torch.equal(out(model, x), trained)


# ----------------------------------------------------------------------------- (b) only LoRA params move
def test_training_changes_only_lora_parameters(base_dir, data):
    x, y = data
    model = adapters.attach(store.load_base(base_dir), LCFG)
    base_fp = fingerprint(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)

    # One optimisation step (batch >= rows). With B = 0 the gradient of A is exactly zero, so only B moves.
    before = snapshot(model)
    train(model, x, y, settings(batch_size=len(x)))
    after = snapshot(model)
    assert before.keys() == after.keys()
    for n in before:
        if "lora_B" in n:
            assert not torch.equal(before[n], after[n]), f"{n} did not change"
        else:
            assert torch.equal(before[n], after[n]), f"{n} changed"

    # A second epoch of steps: now every LoRA matrix (A and B) moves and the base is still bit-identical.
    train(model, x, y, settings(batch_size=64, seed=8))
    final = snapshot(model)
    for n in before:
        if "lora_" in n:
            assert not torch.equal(after[n], final[n]), f"{n} did not change"
        else:
            assert torch.equal(before[n], final[n]), f"base parameter {n} changed"
    assert fingerprint(model) == base_fp


# ----------------------------------------------------------------------------- (c) save / load
def test_saved_adapter_reloads_on_a_fresh_base_with_identical_outputs(base_dir, data, tmp_path):
    x, y = data
    model = adapters.attach(store.load_base(base_dir), LCFG)
    train(model, x, y, settings(epochs=2))
    expected = out(model, x)
    model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()

    loaded = adapters.load(store.load_base(base_dir), str(tmp_path / "adapter"))
    assert not loaded.training
    assert all(not p.requires_grad for p in loaded.parameters())
    assert torch.equal(out(loaded, x), expected)
    np.testing.assert_array_equal(predict(loaded, x), predict(model, x))

    # the adapter carries only LoRA weights: on a *different* base the outputs differ
    torch.manual_seed(123)
    other = adapters.load(CTRModel(CFG).eval(), str(tmp_path / "adapter"))
    assert not torch.equal(out(other, x), expected)


# ----------------------------------------------------------------------------- (d) targets and size
def test_only_the_named_projections_get_lora_modules(base_dir):
    model = adapters.attach(store.load_base(base_dir), LCFG)
    wrapped = sorted(n for n, m in model.named_modules() if isinstance(m, LoraLayer))
    assert [n.rsplit(".", 1)[-1] for n in wrapped] == ["q_proj", "v_proj"] * CFG.n_blocks
    lora_param_owners = {n.split(".lora_")[0] for n, _ in model.named_parameters() if "lora_" in n}
    assert {o.rsplit(".", 1)[-1] for o in lora_param_owners} == {"q_proj", "v_proj"}

    all_four = adapters.attach(
        store.load_base(base_dir),
        LoraTrainConfig(r=4, alpha=8, target_modules=("q_proj", "k_proj", "v_proj", "o_proj")),
    )
    assert len([m for m in all_four.modules() if isinstance(m, LoraLayer)]) == 4 * CFG.n_blocks


def test_trainable_fraction_is_below_one_percent_with_default_configs():
    torch.manual_seed(0)
    model = adapters.attach(CTRModel(ModelConfig()), LoraTrainConfig())
    sizes = adapters.trainable_fraction(model)
    manual = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert sizes["trainable_params"] == manual > 0
    assert sizes["total_params"] == sum(p.numel() for p in model.parameters())
    assert sizes["trainable_fraction"] < 0.01
    # r x d (A) + d x r (B) per targeted projection
    mc, lc = ModelConfig(), LoraTrainConfig()
    assert manual == mc.n_blocks * len(lc.target_modules) * 2 * lc.r * mc.embed_dim


def test_attach_freezes_the_base_even_if_it_was_trainable():
    torch.manual_seed(0)
    base = CTRModel(CFG)
    assert all(p.requires_grad for p in base.parameters())
    model = adapters.attach(base, LCFG)
    assert all(("lora_" in n) == p.requires_grad for n, p in model.named_parameters())


# ----------------------------------------------------------------------------- training loop
def test_lr_schedule_warms_up_then_decays_to_ten_percent():
    base, warm, total = 1e-2, 10, 110
    lrs = [lr_at(s, total, base, warm) for s in range(total + 1)]
    assert lrs[0] == pytest.approx(base / warm)
    assert lrs[warm - 1] == pytest.approx(base)
    assert all(a < b for a, b in zip(lrs[:warm], lrs[1:warm]))  # strictly increasing warm-up
    assert lrs[warm] == pytest.approx(base)  # peak right after warm-up
    assert all(a >= b for a, b in zip(lrs[warm:], lrs[warm + 1 :]))  # non-increasing decay
    assert lrs[warm + (total - warm) // 2] == pytest.approx(base * 0.55)  # cosine midpoint
    assert lrs[total] == pytest.approx(base * 0.1)
    assert lr_at(10 * total, total, base, warm) == pytest.approx(base * 0.1)  # floor, never below
    assert min(lrs) >= base * 0.1 - 1e-12 and max(lrs) <= base + 1e-12
    # no warm-up: starts at the peak
    assert lr_at(0, total, base, 0) == pytest.approx(base)


def test_train_is_deterministic_for_a_seed(data):
    x, y = data
    torch.manual_seed(0)
    init = CTRModel(CFG)
    runs = []
    for seed in (7, 7, 8):
        m = copy.deepcopy(init)
        hist = train(m, x, y, settings(epochs=2, batch_size=32, lr=1e-2, seed=seed, weight_decay=1e-4))
        runs.append((m.state_dict(), hist))
    (a, ha), (b, hb), (c, _) = runs
    assert len(ha) == 2 and [h["epoch"] for h in ha] == [1, 2]
    assert all(np.isfinite(h["train_loss"]) for h in ha)
    assert [h["train_loss"] for h in ha] == [h["train_loss"] for h in hb]
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # the weights did move, and a different seed (batch order) gives different weights
    assert any(not torch.equal(a[k], init.state_dict()[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_train_reports_validation_metrics_and_calls_on_epoch(data):
    x, y = data
    torch.manual_seed(0)
    m = CTRModel(CFG)
    seen = []
    hist = train(m, x[:192], y[:192], settings(epochs=2, batch_size=64), val=(x[192:], y[192:]), on_epoch=seen.append)
    assert seen == hist and len(hist) == 2
    assert {"val_auc", "val_logloss", "train_loss", "samples_per_s"} <= set(hist[-1])
    assert hist[-1]["val_logloss"] > 0
    assert not m.training  # left in eval mode


def test_train_refuses_a_model_without_trainable_parameters(data):
    x, y = data
    frozen = CTRModel(CFG).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        train(frozen, x, y, settings())


def test_predict_returns_probabilities_in_row_order(data):
    x, _ = data
    torch.manual_seed(0)
    m = CTRModel(CFG).train()
    p = predict(m, x, batch_size=100)  # several batches
    assert p.shape == (len(x),) and ((p > 0) & (p < 1)).all()
    np.testing.assert_allclose(p, torch.sigmoid(out(m, x)).numpy(), rtol=1e-6, atol=1e-7)
    m.train()
    predict(m, x)
    assert m.training  # previous mode restored
