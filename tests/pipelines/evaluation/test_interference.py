"""Adapter interference (|cos| of B @ A updates) on real PEFT adapters of the real CTR model."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pipelines.config import LoraTrainConfig, ModelConfig
from pipelines.evaluation.interference import ADAPTER_FILE, adapter_interference, delta_weights
from pipelines.metrics import EvaluationInputError
from pipelines.model.base import CTRModel
from pipelines.model import adapters

CFG = ModelConfig(id_buckets=64, small_buckets=8, embed_dim=8, n_heads=2, n_blocks=1)
Q = "blocks.0.q_proj"
V = "blocks.0.v_proj"


def peft_adapter(seed: int, targets=("q_proj", "v_proj"), r: int = 2):
    """A real PEFT adapter with random A and B (a fresh one has B = 0, i.e. no update at all)."""
    torch.manual_seed(0)
    model = adapters.attach(CTRModel(CFG), LoraTrainConfig(r=r, alpha=2 * r, target_modules=targets))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.named_parameters():
            if "lora_" in name:
                t.copy_(torch.randn(t.shape, generator=g))
    return model


def saved(model, directory) -> str:
    adapters.save(model, directory)
    return str(directory)


def brute_abs_cos(sd1: dict, sd2: dict, module: str) -> float:
    def dw(sd):
        a = next(v for k, v in sd.items() if k.startswith(f"base_model.model.{module}.lora_") and "_A" in k)
        b = next(v for k, v in sd.items() if k.startswith(f"base_model.model.{module}.lora_") and "_B" in k)
        return (b.double() @ a.double()).flatten().numpy()

    u, v = dw(sd1), dw(sd2)
    return abs(float(u @ v)) / (np.linalg.norm(u) * np.linalg.norm(v))


def test_identical_adapters_have_cos_1(tmp_path):
    d = saved(peft_adapter(1), tmp_path / "a")
    r = adapter_interference({"a": d, "b": d})
    assert set(r["modules"]) == {Q, V}
    for m in (Q, V):
        assert r["modules"][m]["max_abs_cos"] == pytest.approx(1.0, abs=1e-12) and r["modules"][m]["pair"] == ["a", "b"]
    assert r["max_abs_cos"] == pytest.approx(1.0, abs=1e-12) and r["pair"] == ["a", "b"] and r["module"] in (Q, V)
    assert json.loads(json.dumps(r, allow_nan=False)) == r


def test_sign_flipped_b_is_still_full_interference(tmp_path):
    d = saved(peft_adapter(1), tmp_path / "a")
    sd = load_file(f"{d}/{ADAPTER_FILE}")
    flipped = {k: (-v if "lora_B" in k else v) for k, v in sd.items()}
    r = adapter_interference({"a": d, "flipped": flipped})
    assert r["modules"][Q]["max_abs_cos"] == pytest.approx(1.0, abs=1e-12)
    assert r["modules"][V]["norms"]["a"] == pytest.approx(r["modules"][V]["norms"]["flipped"])
    # the signed cosine really is -1: the updates point opposite ways
    u = delta_weights(sd)[Q].ravel()
    w = delta_weights(flipped)[Q].ravel()
    assert float(u @ w) / (np.linalg.norm(u) * np.linalg.norm(w)) == pytest.approx(-1.0)


def test_independent_adapters_match_brute_force_and_are_small(tmp_path):
    targets = ("q_proj", "v_proj", "embeddings")
    dirs = {f"s{s}": saved(peft_adapter(s, targets), tmp_path / f"s{s}") for s in (1, 2, 3)}
    r = adapter_interference(dirs)
    sds = {n: load_file(f"{d}/{ADAPTER_FILE}") for n, d in dirs.items()}
    assert len(r["modules"]) == 2 + 9  # q, v and the nine embedding tables
    for module, m in r["modules"].items():
        pairs = {
            f"{a}|{b}": brute_abs_cos(sds[a], sds[b], module) for a, b in (("s1", "s2"), ("s1", "s3"), ("s2", "s3"))
        }
        assert m["pairs"] == pytest.approx(pairs, abs=1e-12)
        assert m["max_abs_cos"] == pytest.approx(max(pairs.values()), abs=1e-12)
    big = r["modules"]["embeddings.user_id"]  # 64 x 8 update: random directions are near-orthogonal
    assert big["max_abs_cos"] < 0.15
    assert r["max_abs_cos"] == max(m["max_abs_cos"] for m in r["modules"].values()) < 0.5


def test_orthogonal_updates_have_cos_0():
    # A rows span input coordinates {0, 1} in one adapter and {2, 3} in the other: the updates' columns
    # live on disjoint coordinates, so their Frobenius inner product is exactly 0
    rng = np.random.default_rng(0)
    eye = torch.eye(8)

    def sd(rows):
        return {
            f"base_model.model.{Q}.lora_A.weight": eye[rows],
            f"base_model.model.{Q}.lora_B.weight": torch.from_numpy(rng.normal(size=(8, 2))).float(),
        }

    r = adapter_interference({"x": sd([0, 1]), "y": sd([2, 3])})
    assert r["modules"][Q]["max_abs_cos"] == 0.0 and r["max_abs_cos"] == 0.0 and r["pair"] == ["x", "y"]


def test_in_memory_state_dict_equals_the_saved_files_and_scaling_only_moves_norms(tmp_path):
    model = peft_adapter(4)
    d = saved(model, tmp_path / "m")
    other = saved(peft_adapter(5), tmp_path / "o")
    live = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert any(".default." in k for k in live)
    r_file = adapter_interference({"m": d, "o": other})
    r_live = adapter_interference({"m": live, "o": other})
    assert r_live["modules"][Q]["max_abs_cos"] == pytest.approx(r_file["modules"][Q]["max_abs_cos"], abs=1e-12)
    scaled = adapter_interference({"m": d, "o": other}, scalings={"m": 2.0})
    assert scaled["modules"][Q]["max_abs_cos"] == pytest.approx(r_file["modules"][Q]["max_abs_cos"], abs=1e-12)
    assert scaled["modules"][Q]["norms"]["m"] == pytest.approx(2 * r_file["modules"][Q]["norms"]["m"])
    # a file path works as well as its directory
    assert adapter_interference({"m": f"{d}/{ADAPTER_FILE}", "o": other})["max_abs_cos"] == r_file["max_abs_cos"]


def test_one_adapter_untrained_adapters_and_partial_overlap(tmp_path):
    d = saved(peft_adapter(1), tmp_path / "a")
    assert adapter_interference({"a": d}) == {
        "adapters": ["a"],
        "modules": {},
        "max_abs_cos": None,
        "pair": None,
        "module": None,
    }
    torch.manual_seed(0)
    fresh = adapters.attach(CTRModel(CFG), LoraTrainConfig(r=2, alpha=4))  # B = 0: no update yet
    r = adapter_interference({"a": d, "fresh": saved(fresh, tmp_path / "f")})
    assert r["modules"][Q]["max_abs_cos"] is None and r["max_abs_cos"] is None
    assert r["modules"][Q]["norms"]["fresh"] == 0.0
    # a module only one adapter has is listed, with nothing to compare it with
    q_only = saved(peft_adapter(2, targets=("q_proj",)), tmp_path / "q")
    r = adapter_interference({"a": d, "q": q_only})
    assert r["modules"][V] == {
        "max_abs_cos": None,
        "pair": None,
        "adapters": ["a"],
        "pairs": {},
        "norms": {
            "a": pytest.approx(math.sqrt(float((delta_weights(load_file(f"{d}/{ADAPTER_FILE}"))[V] ** 2).sum())))
        },
    }
    assert r["module"] == Q and r["modules"][Q]["max_abs_cos"] is not None


def test_bad_adapters(tmp_path):
    d = saved(peft_adapter(1), tmp_path / "a")
    with pytest.raises(EvaluationInputError, match="no adapter at"):
        adapter_interference({"a": d, "b": tmp_path / "missing"})
    with pytest.raises(EvaluationInputError, match="no LoRA matrices"):
        adapter_interference({"a": d, "b": {"blocks.0.q_proj.weight": torch.zeros(8, 8)}})
    with pytest.raises(EvaluationInputError, match="lora_A only"):
        adapter_interference({"a": d, "b": {f"base_model.model.{Q}.lora_A.weight": torch.zeros(2, 8)}})
    two = {
        f"base_model.model.{m}.lora_{ab}.{name}.weight": torch.ones(shape)
        for m, name in ((Q, "x"), (V, "y"))
        for ab, shape in (("A", (2, 8)), ("B", (8, 2)))
    }
    with pytest.raises(EvaluationInputError, match="several adapters"):
        adapter_interference({"a": d, "b": two})
    wide = {
        f"base_model.model.{Q}.lora_A.weight": torch.ones(2, 16),
        f"base_model.model.{Q}.lora_B.weight": torch.ones(8, 2),
    }
    with pytest.raises(EvaluationInputError, match=r"is \(8, 8\) in a but \(8, 16\) in b"):
        adapter_interference({"a": d, "b": wide})
