"""Feature hashing, the CTR model, its weight fingerprint and the safetensors store (real torch + PEFT)."""

from __future__ import annotations

import copy
import json

import numpy as np
import pandas as pd
import pytest
import torch

from pipelines.config import LoraTrainConfig, ModelConfig, from_dict, to_dict
from pipelines.data.schema import FEATURE_FIELDS
from pipelines.data.synthetic import SyntheticSpec, generate_day
from pipelines.errors import ConfigError
from pipelines.model import adapters, features, store
from pipelines.model.base import CTRModel, fingerprint

CFG = ModelConfig(embed_dim=16, n_heads=2, n_blocks=1, id_buckets=1024)
SPEC = SyntheticSpec(n_users=2_000, n_items=300, n_advertisers=30, new_users_per_day=100, new_items_per_day=10, seed=7)


@pytest.fixture(scope="module")
def frame() -> pd.DataFrame:
    return pd.concat(list(generate_day(SPEC, "2024-01-03", 256)), ignore_index=True)


@pytest.fixture(scope="module")
def tokens(frame) -> torch.Tensor:
    return torch.from_numpy(features.encode(frame, CFG))


def make_model(seed: int = 0) -> CTRModel:
    torch.manual_seed(seed)
    return CTRModel(CFG).eval()


# ----------------------------------------------------------------------------- features
def test_encode_shape_dtype_and_ranges(frame):
    x = features.encode(frame, CFG)
    assert x.shape == (len(frame), len(FEATURE_FIELDS)) and x.dtype == np.int64
    sizes = features.field_sizes(CFG)
    for j, f in enumerate(FEATURE_FIELDS):
        assert x[:, j].min() >= 0 and x[:, j].max() < sizes[f], f
    # small ints are used as-is, ids are hashed (so they spread over the table)
    assert (x[:, FEATURE_FIELDS.index("hour")] == frame["hour"].to_numpy()).all()
    assert (x[:, FEATURE_FIELDS.index("weekday")] == frame["weekday"].to_numpy()).all()
    assert len(np.unique(x[:, FEATURE_FIELDS.index("user_id")])) > 20


def test_encode_is_deterministic_and_row_wise(frame):
    a = features.encode(frame, CFG)
    b = features.encode(frame.copy(), CFG)
    np.testing.assert_array_equal(a, b)
    # a row's tokens do not depend on the other rows of the frame
    rev = features.encode(frame.iloc[::-1].reset_index(drop=True), CFG)
    np.testing.assert_array_equal(rev[::-1], a)
    # Known values: pandas' hash_array uses a fixed SipHash key, so buckets are the same in every process
    # and release; a change here would silently re-map every id a trained model has seen.
    one = pd.DataFrame(
        {f: ["u1"] if f == "user_id" else ([3] if f in ("hour", "weekday") else ["x"]) for f in FEATURE_FIELDS}
    )
    assert features.encode(one, CFG).tolist() == [[893, 189, 61, 61, 61, 61, 61, 3, 3]]


def test_unseen_ids_and_nulls_still_map_in_range(frame):
    odd = frame.head(4).copy()
    odd["user_id"] = pd.array(["never-seen-" + "z" * 500, "", None, "u999999999"], dtype="string")
    odd["item_id"] = pd.array(["i-unknown", None, "ü-ñ-✓", "i0"], dtype="string")
    odd["category"] = pd.array([None, None, "brand-new-category", "retail"], dtype="string")
    x = features.encode(odd, CFG)
    sizes = features.field_sizes(CFG)
    for j, f in enumerate(FEATURE_FIELDS):
        assert ((0 <= x[:, j]) & (x[:, j] < sizes[f])).all(), f
    # out-of-range small ints are clipped into the table, not wrapped
    odd2 = frame.head(2).copy()
    odd2["hour"] = np.array([-5, 500], dtype=np.int64)
    h = features.encode(odd2, CFG)[:, FEATURE_FIELDS.index("hour")]
    assert list(h) == [0, CFG.small_buckets - 1]


def test_different_ids_usually_get_different_buckets():
    n = 200
    df = pd.DataFrame(
        {f: [f"{f}-{i}" for i in range(n)] if f not in ("hour", "weekday") else [1] * n for f in FEATURE_FIELDS}
    )
    ids = features.encode(df, CFG)[:, FEATURE_FIELDS.index("user_id")]
    assert len(set(ids)) > 0.8 * n  # 200 ids in 1024 buckets: a few collisions at most


def test_labels_are_float32(frame):
    y = features.labels(frame)
    assert y.dtype == np.float32 and set(np.unique(y)) <= {0.0, 1.0}


# ----------------------------------------------------------------------------- model
def test_forward_shape_and_finite_logits(tokens):
    m = make_model()
    with torch.no_grad():
        out = m(tokens)
    assert out.shape == (len(tokens),) and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    assert out.std() > 0  # not a constant output


def test_attention_projections_are_named_for_lora():
    names = {n for n, _ in make_model().named_modules()}
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert f"blocks.0.{proj}" in names


# ----------------------------------------------------------------------------- fingerprint
def test_fingerprint_is_stable_and_seed_dependent():
    a, b = make_model(0), make_model(0)
    assert fingerprint(a) == fingerprint(a) == fingerprint(b)
    assert len(fingerprint(a)) == 64
    assert fingerprint(make_model(1)) != fingerprint(a)


def test_fingerprint_changes_when_one_weight_changes():
    m = make_model()
    before = fingerprint(m)
    with torch.no_grad():
        w = m.blocks[0].v_proj.weight
        w[3, 5] = torch.nextafter(w[3, 5], torch.tensor(1.0))  # the smallest possible change
    assert fingerprint(m) != before


def test_fingerprint_of_peft_wrapped_base_equals_plain_base(tokens):
    base = make_model()
    plain = fingerprint(base)
    wrapped = adapters.attach(copy.deepcopy(base), LoraTrainConfig(r=4, alpha=8))
    assert any("lora_" in k for k in wrapped.state_dict())  # really wrapped
    assert fingerprint(wrapped) == plain
    # ... but a wrapped *different* base does not match
    other = adapters.attach(make_model(1), LoraTrainConfig(r=4, alpha=8))
    assert fingerprint(other) != plain


# ----------------------------------------------------------------------------- store
def test_store_round_trip_identical_outputs_and_frozen(tmp_path, tokens):
    m = make_model()
    meta = store.save_base(m, tmp_path / "base")
    assert (tmp_path / "base" / store.WEIGHTS).is_file() and (tmp_path / "base" / store.CONFIG).is_file()
    assert meta["fingerprint"] == fingerprint(m)
    assert meta["model"]["embed_dim"] == CFG.embed_dim

    loaded = store.load_base(tmp_path / "base")
    assert loaded.cfg == CFG
    assert not loaded.training
    assert all(not p.requires_grad for p in loaded.parameters())
    assert fingerprint(loaded) == meta["fingerprint"]
    with torch.no_grad():
        assert torch.equal(m(tokens), loaded(tokens))
    for (ka, va), (kb, vb) in zip(m.state_dict().items(), loaded.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)


def test_store_load_refuses_a_tampered_config(tmp_path):
    """The stored config goes through the typed loader: an unknown key is a ConfigError, not ignored."""
    store.save_base(make_model(), tmp_path)
    meta = json.loads((tmp_path / store.CONFIG).read_text())
    meta["model"]["embed_dimm"] = 8
    (tmp_path / store.CONFIG).write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="embed_dimm"):
        store.load_base(tmp_path)


# ----------------------------------------------------------------------------- optional wide term
WIDE = ModelConfig(embed_dim=16, n_heads=2, n_blocks=1, id_buckets=1024, wide=True)
# The state_dict keys of the default model (before `wide` existed): a new option must not change them.
DEFAULT_KEYS = (
    {f"embeddings.{f}.weight" for f in FEATURE_FIELDS}
    | {"field_pos", "norm.weight", "norm.bias", "head.weight", "head.bias"}
    | {
        f"blocks.0.{m}.{p}"
        for m in ("norm1", "q_proj", "k_proj", "v_proj", "o_proj", "norm2", "ffn_in", "ffn_out")
        for p in ("weight", "bias")
    }
)


def test_default_model_has_the_original_state_dict_keys():
    assert ModelConfig().wide is False
    assert set(make_model().state_dict()) == DEFAULT_KEYS
    assert make_model().wide is None


def test_wide_adds_zero_initialised_bias_tables_and_keeps_the_other_weights(tokens):
    torch.manual_seed(0)
    wide = CTRModel(WIDE).eval()
    plain = make_model(0)
    sd, sd_plain = wide.state_dict(), plain.state_dict()
    extra = set(sd) - set(sd_plain)
    assert extra == {f"wide.{f}.weight" for f in FEATURE_FIELDS} and set(sd_plain) <= set(sd)
    sizes = features.field_sizes(WIDE)
    for f in FEATURE_FIELDS:
        assert tuple(sd[f"wide.{f}.weight"].shape) == (sizes[f], 1) and not sd[f"wide.{f}.weight"].any()
    for k, v in sd_plain.items():  # same seed, same weights: the wide tables draw no random numbers
        assert torch.equal(sd[k], v), k
    with torch.no_grad():
        assert torch.equal(wide(tokens), plain(tokens))  # zero biases: the same function at init
        wide.wide["item_id"].weight[tokens[0, 1]] = 0.5
        out = wide(tokens)
        logits, pooled = wide.logits_and_pooled(tokens)
        assert torch.equal(out, logits) and pooled.shape == (len(tokens), WIDE.embed_dim)
        assert torch.allclose(out - plain(tokens), 0.5 * (tokens[:, 1] == tokens[0, 1]).float())


def test_wide_model_trains_its_bias_tables_and_lora_still_targets_the_attention(tokens):
    torch.manual_seed(0)
    wide = CTRModel(WIDE)
    y = torch.randint(0, 2, (len(tokens),)).float()
    torch.nn.functional.binary_cross_entropy_with_logits(wide(tokens), y).backward()
    assert wide.wide["item_id"].weight.grad.abs().sum() > 0
    base = CTRModel(WIDE).eval()
    plain_fp = fingerprint(base)
    model = adapters.attach(base, LoraTrainConfig(r=4, alpha=8))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n and (".q_proj." in n or ".v_proj." in n) for n in trainable)
    assert fingerprint(model) == plain_fp
    with torch.no_grad():
        assert torch.equal(model(tokens), base(tokens))  # B = 0: the adapter starts at the base


def test_wide_config_is_validated_and_round_trips(tmp_path, tokens):
    with pytest.raises(ConfigError, match="wide"):
        ModelConfig(wide="yes")
    with pytest.raises(ConfigError, match="wide"):
        from_dict(ModelConfig, {"wide": 1})
    assert from_dict(ModelConfig, to_dict(WIDE)) == WIDE
    assert from_dict(ModelConfig, {k: v for k, v in to_dict(CFG).items() if k != "wide"}) == CFG  # old configs load
    torch.manual_seed(0)
    m = CTRModel(WIDE).eval()
    store.save_base(m, tmp_path)
    loaded = store.load_base(tmp_path)
    assert loaded.cfg.wide and fingerprint(loaded) == fingerprint(m)
    with torch.no_grad():
        assert torch.equal(loaded(tokens), m(tokens))


# ------------------------------------------------------------- wide id tables larger than the embeddings
FINE = ModelConfig(embed_dim=16, n_heads=2, n_blocks=1, id_buckets=1024, wide=True, wide_id_buckets=8 * 1024)


def test_wide_id_buckets_give_the_lr_rows_of_its_own_and_the_embeddings_the_rows_they_had(frame):
    """Ids hash into wide_id_buckets rows; the embeddings read the token modulo id_buckets, the row the
    same id has without the option, so the deep part is the same function of the same ids."""
    fine, coarse = features.encode(frame, FINE), features.encode(frame, WIDE)
    ids = [FEATURE_FIELDS.index(f) for f in features.ID_FIELDS]
    assert fine[:, ids].max() >= WIDE.id_buckets and fine[:, ids].max() < FINE.wide_id_buckets
    np.testing.assert_array_equal(fine[:, ids] % WIDE.id_buckets, coarse[:, ids])
    others = [i for i in range(len(FEATURE_FIELDS)) if i not in ids]
    np.testing.assert_array_equal(fine[:, others], coarse[:, others])
    torch.manual_seed(0)
    big = CTRModel(FINE).eval()
    torch.manual_seed(0)
    small = CTRModel(WIDE).eval()
    assert big.wide["user_id"].num_embeddings == FINE.wide_id_buckets
    assert big.embeddings["user_id"].num_embeddings == small.embeddings["user_id"].num_embeddings == 1024
    with torch.no_grad():
        assert torch.equal(big(torch.from_numpy(fine)), small(torch.from_numpy(coarse)))  # zero wide tables


def test_two_ids_sharing_an_embedding_row_keep_wide_weights_of_their_own():
    model = CTRModel(FINE).eval()
    u = FEATURE_FIELDS.index("user_id")
    a, b = np.zeros((1, len(FEATURE_FIELDS)), np.int64), np.zeros((1, len(FEATURE_FIELDS)), np.int64)
    a[0, u], b[0, u] = 5, 5 + FINE.id_buckets  # one embedding row, two wide rows
    with torch.no_grad():
        model.wide["user_id"].weight[5 + FINE.id_buckets] = 1.0
        la, lb = model(torch.from_numpy(a)), model(torch.from_numpy(b))
    assert float(lb - la) == pytest.approx(1.0, abs=1e-6)
    targets = adapters.token_targets(
        model, LoraTrainConfig(trainable_tokens=("user_id",)), {"user_id": [5, 5 + FINE.id_buckets]}
    )
    assert targets == {"embeddings.user_id": [5], "wide.user_id": [5, 5 + FINE.id_buckets]}


def test_wide_id_buckets_need_the_wide_term_and_a_multiple_of_id_buckets():
    with pytest.raises(ConfigError, match="wide_id_buckets"):
        ModelConfig(id_buckets=1024, wide_id_buckets=4096)  # no wide term
    with pytest.raises(ConfigError, match="multiple of model.id_buckets"):
        ModelConfig(id_buckets=1024, wide=True, wide_id_buckets=3000)
