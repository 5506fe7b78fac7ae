"""serving.batched: one mixed forward == each row through PEFT's own single-adapter model (no registry)."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from pipelines.bench import serving_demo as demo
from pipelines.config import LoraTrainConfig, TextConfig
from pipelines.model import adapters, family
from pipelines.model.base import CTRModel
from pipelines.serving import batched
from tests.pipelines.serving import fixtures

CONFIGS = (
    LoraTrainConfig(),  # q/v, r=8
    LoraTrainConfig(r=4, alpha=8, target_modules=("q_proj", "v_proj", "embeddings")),
    LoraTrainConfig(r=2, alpha=2, target_modules=("k_proj", "o_proj")),
    LoraTrainConfig(rank_pattern={"blocks.0.q_proj": 2, "v_proj": 4}),  # per-layer ranks: q 2, v 4
)


# the dcn family (model.dcn): LoRA on its cross layers and deep tower, on the tables, with per-layer ranks
DCN_CONFIGS = (
    LoraTrainConfig(target_modules=("cross_proj", "deep_proj")),
    LoraTrainConfig(r=4, alpha=8, target_modules=("cross_proj", "embeddings")),
    LoraTrainConfig(target_modules=("cross_proj", "deep_proj"), rank_pattern={"deep.0.deep_proj": 2}),
)


# the minilm_text family (model.text): LoRA on the attention projections and the head, per-layer ranks
TEXT_CONFIGS = (
    LoraTrainConfig(target_modules=("query", "value")),
    LoraTrainConfig(r=4, alpha=8, target_modules=("key", "value"), rank_pattern={"layer.1.attention.self.value": 2}),
    LoraTrainConfig(r=2, alpha=4, target_modules=("query", "head_proj")),
    LoraTrainConfig(target_modules=("query", "value"), layers=(-1,)),  # the top layer only
)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch.manual_seed(0)
    return _setup(CTRModel(fixtures.CFG).eval().requires_grad_(False), CONFIGS, tmp_path_factory)


@pytest.fixture(scope="module")
def dcn_setup(tmp_path_factory):
    torch.manual_seed(0)
    base = family.build(replace(fixtures.CFG, family="dcn")).eval().requires_grad_(False)
    return _setup(base, DCN_CONFIGS, tmp_path_factory)


@pytest.fixture(scope="module")
def text_setup(tmp_path_factory, text_source):
    torch.manual_seed(0)
    cfg = replace(fixtures.CFG, family="minilm_text", text=TextConfig(source=text_source, max_len=32))
    base = family.build(cfg).eval().requires_grad_(False)
    return _setup(base, TEXT_CONFIGS, tmp_path_factory)


def _inputs(which: str, base) -> torch.Tensor:
    """Rows of the family's input: 64 of random ids per field, or the words of 600 synthetic impressions (of
    unequal length: the batch is cut to its longest row, a row alone to its own)."""
    if which == "text_setup":
        return torch.from_numpy(family.encode(fixtures.rows(600), base.cfg))  # more than any slice of rows
    gen = torch.Generator().manual_seed(1)
    return torch.stack([torch.randint(0, n, (64,), generator=gen) for n in (64, 64, 8, 8, 8, 8, 8, 8, 8)], dim=1)


def _setup(base, configs, tmp_path_factory):
    store, singles, names = copy.deepcopy(base), [], []
    peft = None
    for i, cfg in enumerate(configs):
        d = tmp_path_factory.mktemp(f"adapter{i}")
        adapters.save(demo.random_adapter(base, seed=i, lora_cfg=cfg), d)
        singles.append(adapters.load(copy.deepcopy(base), str(d)))
        names.append(f"a{i}")
        if peft is None:
            peft = PeftModel.from_pretrained(store, str(d), adapter_name=names[-1])
        else:
            peft.load_adapter(str(d), adapter_name=names[-1])
    return base, store, names, singles


@pytest.mark.parametrize(
    "which,layer",
    [
        ("setup", "blocks.0.k_proj"),
        ("dcn_setup", "deep.0.deep_proj"),
        ("text_setup", "bert.encoder.layer.1.attention.self.key"),
    ],
)
def test_mixed_batch_equals_each_rows_single_adapter_model(which, layer, request):
    base, store, names, singles = request.getfixturevalue(which)
    stacks = batched.build_stacks(store, names)
    assert any(s.embedding for s in stacks.values()) == (which != "text_setup")  # text: no id tables
    assert layer in stacks
    tree = batched.serving_tree(base, frozenset(stacks))
    x = _inputs(which, base)
    rows = torch.arange(len(x)) % (len(names) + 1)  # 0 = base, i = names[i - 1]
    with torch.inference_mode():
        with batched.request(stacks, rows):
            mixed = tree(x)
        expected = torch.empty(len(x))
        for i, model in enumerate([base, *singles]):
            expected[rows == i] = model(x[rows == i])
        outside = tree(x)  # outside a request the hooks add nothing
        base_out = base(x)
    torch.testing.assert_close(mixed, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(outside, base_out, atol=0, rtol=0)
    assert (mixed[rows > 0] - base_out[rows > 0]).abs().min() > 0, "every adapter changes its rows"


def test_serving_tree_shares_the_base_tensors_and_leaves_the_base_unhooked(setup):
    base, store, names, _ = setup
    tree = batched.serving_tree(base, frozenset(batched.build_stacks(store, names[:1])))
    assert tree is not base and tree.blocks[0].q_proj is not base.blocks[0].q_proj
    assert tree.blocks[0].q_proj.weight is base.blocks[0].q_proj.weight
    assert tree.blocks[0].q_proj._forward_hooks and not base.blocks[0].q_proj._forward_hooks
    assert not tree.blocks[0].k_proj._forward_hooks, "only the layers the adapters target are hooked"


def test_dora_adapter_is_reported_unsupported(setup):
    base = setup[0]
    model = get_peft_model(
        copy.deepcopy(base), LoraConfig(r=2, target_modules=["q_proj"], use_dora=True), adapter_name="dora"
    )
    problems = batched.unsupported(model.get_base_model(), "dora", batched.hookable(base))
    assert problems and all("variant" in p for p in problems)
    assert batched.unsupported(setup[1], "a0", batched.hookable(base)) == []
