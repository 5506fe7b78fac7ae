"""Adapters with trainable id rows (lora.trainable_tokens, issue 14): real PEFT on the real CTR model.
An adapter can give users and items the frozen base never saw rows of their own; everything else of
the base stays as it was, and the rows travel with the adapter's files."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from pipelines.config import LoraTrainConfig, ModelConfig
from pipelines.errors import ConfigError
from pipelines.model import adapters, features
from pipelines.model.base import CTRModel, fingerprint
from pipelines.training.loop import train
from tests.pipelines.model.test_adapters import CFG, data, out, settings  # noqa: F401 (data: a fixture)

TOKENS = LoraTrainConfig(r=4, alpha=8, target_modules=("q_proj", "v_proj"), trainable_tokens=("user_id", "item_id"))
USER, ITEM = list(features.FEATURE_FIELDS).index("user_id"), list(features.FEATURE_FIELDS).index("item_id")


def fresh(wide: bool = False) -> CTRModel:
    torch.manual_seed(0)
    return CTRModel(ModelConfig(embed_dim=16, n_heads=2, n_blocks=1, id_buckets=1024, wide=wide)).eval()


def window_rows(x: np.ndarray) -> dict[str, list[int]]:
    """The id rows of the first half of the batch: the "window" the adapter trains its rows for."""
    half = x[: len(x) // 2]
    return {"user_id": sorted(set(half[:, USER].tolist())), "item_id": sorted(set(half[:, ITEM].tolist()))}


def table(model, name: str, field: str) -> torch.Tensor:
    """The rows a forward pass uses for `field` (the base table with the adapter's rows put in)."""
    ids = torch.arange(model.get_base_model().cfg.id_buckets)
    layer = getattr(model.get_base_model(), name)[field]
    with torch.no_grad():
        return layer(ids).clone()


@pytest.mark.parametrize("wide", [False, True])
def test_only_the_chosen_rows_and_the_projections_train(data, wide):
    x, y = data
    rows = window_rows(x)
    base = fresh(wide)
    before = {
        (n, f): table(adapters.attach(fresh(wide), TOKENS, token_rows=rows), n, f)
        for n in ("embeddings", *(("wide",) if wide else ()))
        for f in ("user_id", "item_id")
    }
    model = adapters.attach(base, TOKENS, token_rows=rows)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n or "trainable_tokens_delta" in n for n in names), names
    assert any(".wide.user_id." in n for n in names) is wide  # the wide term's rows too, when there is one
    train(model, x, y, settings(epochs=2, lr=5e-2))
    for (name, field), old in before.items():
        new = table(model, name, field)
        changed = set(torch.nonzero((new - old).abs().sum(dim=1) > 0).flatten().tolist())
        assert changed and changed <= set(rows[field]), (name, field)  # rows of the window only
    assert fingerprint(model) == fingerprint(fresh(wide))  # the frozen base is what adapters are tied to


def test_tokens_only_trains_the_rows_alone_and_leaves_other_ids_scored_as_the_base_scores_them(data):
    x, y = data
    rows = window_rows(x)
    only = LoraTrainConfig(
        r=4, alpha=8, target_modules=("q_proj", "v_proj"), trainable_tokens=("user_id",), tokens_only=True
    )
    model = adapters.attach(fresh(wide=True), only, token_rows={"user_id": rows["user_id"]})
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all("trainable_tokens_delta" in n for n in names), names
    train(model, x, y, settings(epochs=2, lr=5e-2))
    assert all(torch.count_nonzero(p) == 0 for n, p in model.named_parameters() if "lora_B" in n)
    others = ~np.isin(x[:, USER], rows["user_id"])
    assert others.any() and (~others).any()
    base = fresh(wide=True)
    torch.testing.assert_close(out(model, x[others]), out(base, x[others]), rtol=0, atol=1e-6)
    assert not torch.allclose(out(model, x[~others]), out(base, x[~others]), atol=1e-4)


def test_saved_rows_reload_with_identical_outputs_and_cost_what_they_hold(data, tmp_path):
    x, y = data
    rows = window_rows(x)
    model = adapters.attach(fresh(), TOKENS, token_rows=rows)
    train(model, x, y, settings(epochs=1, lr=5e-2))
    adapters.save(model, tmp_path / "tokens")
    loaded = adapters.load(fresh(), str(tmp_path / "tokens"))
    torch.testing.assert_close(out(loaded, x), out(model, x), rtol=0, atol=1e-6)
    stored = (tmp_path / "tokens" / "adapter_model.safetensors").stat().st_size
    plain = adapters.attach(fresh(), LoraTrainConfig(r=4, alpha=8, target_modules=("q_proj", "v_proj")))
    adapters.save(plain, tmp_path / "plain")
    extra = stored - (tmp_path / "plain" / "adapter_model.safetensors").stat().st_size
    n_rows = len(rows["user_id"]) + len(rows["item_id"])
    assert n_rows * CFG.embed_dim * 4 <= extra < n_rows * CFG.embed_dim * 4 + 4096  # k x d floats, not tables


def test_rows_are_refused_for_a_table_the_config_does_not_name_and_none_means_off():
    with pytest.raises(ValueError, match="lora.trainable_tokens"):
        adapters.attach(fresh(), LoraTrainConfig(r=4, alpha=8), token_rows={"user_id": [1, 2]})
    with pytest.raises(ValueError, match="no token rows were given"):  # never silently LoRA-only
        adapters.attach(fresh(), TOKENS)
    model = adapters.attach(fresh(), TOKENS, token_rows={"user_id": [], "item_id": []})  # no ids: LoRA only
    assert not any("trainable_tokens" in n for n, _ in model.named_parameters())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"trainable_tokens": ("gender",)}, "trainable_tokens must name tables"),
        ({"trainable_tokens": ("user_id",), "target_modules": ("q_proj", "embeddings")}, "cannot be combined"),
        ({"tokens_only": True}, "tokens_only needs lora.trainable_tokens"),
    ],
)
def test_the_config_refuses_what_it_cannot_train(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        LoraTrainConfig(**kwargs)


def test_id_buckets_are_the_rows_the_encoder_uses():
    frame = pd.DataFrame({"user_id": ["u1", "u2", "u1", None]})
    got = features.id_buckets(frame["user_id"], "user_id", CFG)
    assert got == sorted(set(features._hash_bucket(frame["user_id"], CFG.id_buckets).tolist()))
    with pytest.raises(ValueError, match="not an id field"):
        features.id_buckets(frame["user_id"], "gender", CFG)
