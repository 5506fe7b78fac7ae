"""LoRA on the embedding tables and trainable LayerNorm biases: what trains, what stays frozen, save -> load."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from peft.tuners.lora import Embedding as LoraEmbedding
from torch import nn

from pipelines.config import LoraTrainConfig, load_pipeline_config
from pipelines.data.schema import FEATURE_FIELDS
from pipelines.errors import ConfigError
from pipelines.model import adapters, family
from pipelines.model.base import fingerprint
from pipelines.model.inference import predict
from pipelines.training.loop import LoopSettings, train
from tests.pipelines.training.helpers import CFG, base, out, rows

SETTINGS = LoopSettings(epochs=2, batch_size=64, lr=2e-2, weight_decay=0.0, warmup_steps=1, seed=7)


@pytest.fixture(scope="module")
def data():
    return rows("2024-01-03", 512)


def base_state() -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in base().state_dict().items()}


def clean(name: str) -> str:
    return name.replace("base_model.model.", "").replace(".base_layer", "")


def test_embeddings_target_expands_to_every_field_table():
    names = adapters.target_names(LoraTrainConfig(target_modules=("q_proj", "embeddings")))
    assert names == ["q_proj"] + [f"embeddings.{f}" for f in FEATURE_FIELDS]


def test_embeddings_target_puts_lora_on_the_tables_and_keeps_them_frozen(data, tmp_path):
    x, y = data
    model = adapters.attach(base(), LoraTrainConfig(r=4, alpha=8, target_modules=("v_proj", "embeddings")))
    wrapped = {n.replace("base_model.model.", "") for n, m in model.named_modules() if isinstance(m, LoraEmbedding)}
    assert wrapped == {f"embeddings.{f}" for f in FEATURE_FIELDS}
    trainable = {clean(n) for n, p in model.named_parameters() if p.requires_grad}
    assert {f"embeddings.{f}.lora_embedding_A.default" for f in FEATURE_FIELDS} <= trainable
    assert all("lora_" in n for n in trainable)

    before = base_state()
    train(model, x, y, SETTINGS)
    after = {clean(k): v for k, v in model.state_dict().items() if "lora_" not in k}
    assert after.keys() == before.keys()
    for k in before:  # every base tensor, the embedding tables included, is bit-identical
        assert torch.equal(after[k], before[k]), k
    assert any(torch.count_nonzero(p) for n, p in model.named_parameters() if "lora_embedding_A" in n)

    expected = out(model, x)
    adapters.save(model, tmp_path / "adapter")
    loaded = adapters.load(base(), str(tmp_path / "adapter"))
    assert torch.equal(out(loaded, x), expected)
    assert not torch.equal(out(base(), x), expected)  # the adapter does change the outputs


def test_layernorm_biases_train_and_round_trip_with_the_adapter(data, tmp_path):
    x, y = data
    lcfg = LoraTrainConfig(r=4, alpha=8, target_modules=("q_proj", "v_proj"), train_layernorm_bias=True)
    model = adapters.attach(base(), lcfg)
    ln_biases = {f"{n}.bias" for n, m in base().named_modules() if isinstance(m, nn.LayerNorm)}
    assert len(ln_biases) == 3  # norm1, norm2 of the one block + the final norm
    trainable = {clean(n) for n, p in model.named_parameters() if p.requires_grad}
    assert ln_biases <= trainable and all("lora_" in n for n in trainable - ln_biases)
    fp_before = fingerprint(model)

    before = base_state()
    train(model, x, y, SETTINGS)
    after = {clean(k): v for k, v in model.state_dict().items() if "lora_" not in k}
    for k in before:
        if k in ln_biases:
            assert not torch.equal(after[k], before[k]), f"{k} did not train"
        else:
            assert torch.equal(after[k], before[k]), f"base weight {k} changed"
    assert fingerprint(model) != fp_before  # the biases are part of the base weights

    expected = out(model, x)
    adapters.save(model, tmp_path / "adapter")
    assert (tmp_path / "adapter" / adapters.LAYERNORM_BIAS_FILE).is_file()
    loaded = adapters.load(base(), str(tmp_path / "adapter"))
    assert not loaded.training and all(not p.requires_grad for p in loaded.parameters())
    assert torch.equal(out(loaded, x), expected)
    np.testing.assert_array_equal(predict(loaded, x), predict(model, x))
    # saving the loaded adapter again keeps the biases (e.g. re-logging a registered version)
    adapters.save(loaded, tmp_path / "again")
    assert torch.equal(out(adapters.load(base(), str(tmp_path / "again")), x), expected)

    # without the biases file the LoRA matrices alone give other outputs: the file is what carries them
    (tmp_path / "adapter" / adapters.LAYERNORM_BIAS_FILE).unlink()
    assert not torch.equal(out(adapters.load(base(), str(tmp_path / "adapter")), x), expected)


def test_without_the_flag_no_biases_file_is_written(data, tmp_path):
    model = adapters.attach(base(), LoraTrainConfig(r=4, alpha=8))
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    adapters.save(model, tmp_path / "adapter")
    assert not (tmp_path / "adapter" / adapters.LAYERNORM_BIAS_FILE).exists()


def test_rank_pattern_gives_per_layer_ranks_and_survives_save_load(tmp_path):
    model = adapters.attach(base(), LoraTrainConfig(r=8, alpha=16, rank_pattern={"blocks.0.v_proj": 2}))
    ranks = {clean(n): m.r["default"] for n, m in model.named_modules() if hasattr(m, "lora_A") and m.lora_A}
    assert ranks == {"blocks.0.q_proj": 8, "blocks.0.v_proj": 2}
    assert model.get_submodule("base_model.model.blocks.0.v_proj").scaling["default"] == 16 / 2  # alpha / its rank
    adapters.save(model, tmp_path)
    loaded = adapters.load(base(), str(tmp_path))
    assert loaded.get_submodule("base_model.model.blocks.0.v_proj").lora_A["default"].weight.shape[0] == 2


def test_rank_pattern_is_checked_against_the_config_and_the_model():
    with pytest.raises(ConfigError, match="matches no module"):
        adapters.attach(base(), LoraTrainConfig(rank_pattern={"blocks.5.v_proj": 2}))
    with pytest.raises(ConfigError, match="must name a module of lora.target_modules"):
        LoraTrainConfig(rank_pattern={"ffn_in": 2})
    with pytest.raises(ConfigError, match="integer rank >= 1"):
        LoraTrainConfig(rank_pattern={"v_proj": 0})

    with pytest.raises(ConfigError, match="names block 2, but model.n_blocks is 2"):
        load_pipeline_config(overrides={"lora": {"rank_pattern": {"blocks.2.v_proj": 4}}})
    assert load_pipeline_config(overrides={"lora": {"rank_pattern": {"blocks.1.v_proj": 4}}}).lora.max_rank == 8
    lc = LoraTrainConfig(r=4, lr=0.01, batch_size=64, rank_pattern={"v_proj": 16})
    assert lc.max_rank == 16 and lc.stability == pytest.approx(0.01 * 16 / 8)  # the rule bounds the largest rank


def _two_blocks():
    return family.build(replace(CFG, n_blocks=2))


def test_layers_wrap_the_targets_of_those_layers_only_and_survive_save_load(tmp_path):
    model = adapters.attach(_two_blocks(), LoraTrainConfig(layers=(1,)))
    wrapped = sorted(n.removeprefix("base_model.model.") for n, m in model.named_modules() if hasattr(m, "lora_A"))
    assert wrapped == ["blocks.1.q_proj", "blocks.1.v_proj"]
    adapters.save(model, tmp_path)
    again = adapters.load(_two_blocks(), str(tmp_path))
    assert (
        sorted(n.removeprefix("base_model.model.") for n, m in again.named_modules() if hasattr(m, "lora_A")) == wrapped
    )


def test_layers_count_from_the_top_when_negative():
    top = adapters.attach(_two_blocks(), LoraTrainConfig(layers=(-1,)))
    assert sorted(n.removeprefix("base_model.model.") for n, m in top.named_modules() if hasattr(m, "lora_A")) == [
        "blocks.1.q_proj",
        "blocks.1.v_proj",
    ]
    both = adapters.attach(_two_blocks(), LoraTrainConfig(layers=(0, -1)))
    assert len([n for n, m in both.named_modules() if hasattr(m, "lora_A")]) == 4


def test_layers_are_checked_against_the_config_and_the_model():
    for bad in ((1, 5), (-3,)):
        with pytest.raises(ConfigError, match=r"sit in 2 numbered layers \(indices 0..1 or -2..-1\)"):
            adapters.attach(_two_blocks(), LoraTrainConfig(layers=bad))
    with pytest.raises(ConfigError, match="distinct layer indices"):
        LoraTrainConfig(layers=(1, 1))
    with pytest.raises(ConfigError, match="the model has 2 blocks"):
        load_pipeline_config(overrides={"lora": {"layers": [2]}})
    with pytest.raises(ConfigError, match="dcn's cross and deep layers are two lists"):
        load_pipeline_config("configs/movielens_dcn.yaml", overrides={"lora": {"layers": [0]}})
    assert load_pipeline_config(overrides={"lora": {"layers": [-1]}}).lora.layers == (-1,)


def test_layers_on_a_model_without_a_layer_list_are_refused():
    dcn = family.build(replace(CFG, family="dcn"))
    with pytest.raises(ConfigError, match="no \\['cross_proj'\\] module sits in a layer list"):
        adapters.attach(dcn, LoraTrainConfig(target_modules=("cross_proj",), layers=(0,)))
