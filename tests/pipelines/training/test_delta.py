"""The delta adapter kind (lora.kind: delta, training.delta): per-id offsets of the wide term's user and item
weights, anchored to zero and trained with Adagrad; real PEFT on the real CTR model. An offset is exactly an
additive change of the logit for that id, everything else scores as the base, and the adapter's files hold
the rows only."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipelines.config import LoraTrainConfig
from pipelines.errors import ConfigError
from pipelines.model import adapters
from pipelines.training import delta
from pipelines.training.loop import fit
from tests.pipelines.model.test_adapters import data, out  # noqa: F401 (data: a fixture)
from tests.pipelines.model.test_token_adapters import USER, fresh, window_rows

DELTA = LoraTrainConfig(
    r=4,
    alpha=8,
    kind="delta",
    trainable_tokens=("user_id", "item_id"),
    lr=0.3,
    warmup_steps=1,
    epochs=2,
    batch_size=64,
    delta_l2=1.0,
)


def offsets(model) -> dict[str, torch.Tensor]:
    """Each trained table's rows minus the base's rows, by module name."""
    return {
        name: (m.trainable_tokens_delta["default"] - m.trainable_tokens_original["default"]).detach()
        for name, m in model.named_modules()
        if hasattr(m, "trainable_tokens_delta")
        and "default" in m.trainable_tokens_delta
        and getattr(m, "tied_adapter", None) is None
    }


def trained(x, y, lc=DELTA):
    model = adapters.attach(fresh(wide=True), lc, token_rows=window_rows(x))
    report = fit(model, (x, y), delta.loop_settings(lc), regularizer=delta.regularizer(lc, len(y)))
    return model, report


def test_a_delta_trains_the_wide_rows_of_the_window_ids_only_and_changes_their_logit_additively(data):
    x, y = data
    model, _ = trained(x, y)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all(".wide." in n and "trainable_tokens_delta" in n for n in names), names
    assert all(torch.count_nonzero(p) == 0 for n, p in model.named_parameters() if "lora_B" in n)
    base = fresh(wide=True)
    moved = {n: o for n, o in offsets(model).items()}
    assert set(moved) == {"base_model.model.wide.user_id.token_adapter", "base_model.model.wide.item_id.token_adapter"}
    # the logit of a row moves by exactly its user's and its item's offsets
    rows = window_rows(x)
    user_off = dict(zip(rows["user_id"], moved["base_model.model.wide.user_id.token_adapter"][:, 0].tolist()))
    item_off = dict(zip(rows["item_id"], moved["base_model.model.wide.item_id.token_adapter"][:, 0].tolist()))
    want = out(base, x) + torch.tensor(
        [user_off.get(int(u), 0.0) + item_off.get(int(i), 0.0) for u, i in x[:, [USER, USER + 1]]]
    )
    torch.testing.assert_close(out(model, x), want, rtol=0, atol=1e-5)
    assert any(float(o.abs().max()) > 1e-3 for o in moved.values())


def test_the_anchor_is_the_l2_of_the_offsets_on_an_lr_scale(data):
    x, y = data
    model, _ = trained(x, y)
    penalty = delta.Anchor(4.0, rows=200)(model)
    want = 4.0 / (2 * 200) * sum(float(o.pow(2).sum()) for o in offsets(model).values())
    assert float(penalty.detach()) == pytest.approx(want, rel=1e-5) and want > 0


def test_a_stronger_anchor_keeps_the_offsets_smaller(data):
    x, y = data
    loose, _ = trained(x, y, dataclasses.replace(DELTA, delta_l2=0.0))
    tight, _ = trained(x, y, dataclasses.replace(DELTA, delta_l2=1000.0))
    size = lambda m: sum(float(o.abs().sum()) for o in offsets(m).values())  # noqa: E731
    assert size(tight) < 0.5 * size(loose)
    assert delta.regularizer(dataclasses.replace(DELTA, delta_l2=0.0), 10) is None


def test_a_delta_trains_with_adagrad_at_its_own_lr_and_a_lora_with_adamw_under_the_stability_rule():
    s = delta.loop_settings(DELTA)
    assert (s.optimizer, s.lr) == ("adagrad", 0.3)  # the LoRA stability rule would cap it at 0.04
    lora = LoraTrainConfig(r=8, lr=0.3, batch_size=256)
    assert delta.loop_settings(lora).optimizer == "adamw" and delta.loop_settings(lora).lr < 0.3


def test_the_saved_delta_reloads_with_identical_scores_and_holds_rows_not_tables(data, tmp_path):
    x, y = data
    model, _ = trained(x, y)
    adapters.save(model, tmp_path / "delta")
    loaded = adapters.load(fresh(wide=True), str(tmp_path / "delta"))
    torch.testing.assert_close(out(loaded, x), out(model, x), rtol=0, atol=1e-6)
    rows = window_rows(x)
    stored = (tmp_path / "delta" / "adapter_model.safetensors").stat().st_size
    assert stored < 4 * (len(rows["user_id"]) + len(rows["item_id"])) + 8192  # one float per id, plus LoRA's zeros


def test_a_delta_needs_id_tables_and_a_base_with_a_wide_term(data):
    x, _ = data
    with pytest.raises(ConfigError, match="kind delta needs lora.trainable_tokens"):
        LoraTrainConfig(kind="delta")
    with pytest.raises(ConfigError, match="model.wide: false"):
        adapters.attach(fresh(wide=False), DELTA, token_rows=window_rows(x))
    with pytest.raises(ConfigError, match="kind"):
        LoraTrainConfig(kind="sparse")
