"""LoRA adapters (HF PEFT) on the frozen base model. Targets are named explicitly.

Besides PEFT's LoRA matrices an adapter may carry the LayerNorm biases of the base
(`lora.train_layernorm_bias`). PEFT has no "LayerNorm biases only" option (`bias="all"` trains
every Linear bias too, `modules_to_save` copies whole modules), so `attach` un-freezes them in
place and `save`/`load` keep them in `layernorm_bias.safetensors` next to PEFT's files.
Consequence: `disable_adapter()` switches the LoRA matrices off but not those biases.

With `lora.trainable_tokens` an adapter also trains the rows of chosen ids in the id tables (PEFT's
`trainable_token_indices`: the rows are stored in the adapter, the tables stay frozen): LoRA on
q/v cannot give a user the base never saw a representation of its own, and these rows can.

`lora.kind: delta` is the per-id adapter (docs/architecture.md, "Model"): the same PEFT
mechanism on the wide term's rows only (`wide.user_id`, `wide.item_id`: one first-order weight per id,
what a daily LR refit moves), the LoRA matrices frozen at zero. Its trained rows minus the base's are
additive offsets of the logit; `training.delta` anchors them to zero and trains them with Adagrad. It is
stored, registered, loaded and served exactly as any adapter with token rows.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from torch import nn

from pipelines.config import LoraTrainConfig
from pipelines.data.schema import FEATURE_FIELDS
from pipelines.errors import ConfigError

log = logging.getLogger(__name__)

LAYERNORM_BIAS_FILE = "layernorm_bias.safetensors"
# Names of the module lists whose numbered entries `lora.layers` indexes (PEFT layers_pattern).
LAYER_LISTS = ("blocks", "layer", "layers")
_LN_FLAG = "_ctr_layernorm_bias"  # set on the PeftModel when its LayerNorm biases belong to the adapter


def target_names(cfg: LoraTrainConfig) -> list[str]:
    """PEFT target_modules: the projection names, with "embeddings" expanded to every field table.

    The tables live in a ModuleDict (`embeddings.user_id`, ...); naming them fully keeps PEFT's
    suffix match from catching anything else.
    """
    out = []
    for t in cfg.target_modules:
        if t == "embeddings":
            out.extend(f"embeddings.{f}" for f in FEATURE_FIELDS)
        else:
            out.append(t)
    return out


def token_targets(base: nn.Module, cfg: LoraTrainConfig, rows: dict[str, list[int]] | None) -> dict[str, list[int]]:
    """PEFT `trainable_token_indices`: for each table of `cfg.trainable_tokens`, the rows in `rows` (table
    -> bucket indices, `features.id_buckets`), on `embeddings.<table>` and, when the base has a wide
    term, on `wide.<table>` too (an id's first-order bias is what a daily refit mostly learns); a `delta`
    adapter on `wide.<table>` alone (a base without a wide term is refused). A table without rows is left
    out; rows for a table the config does not name are refused."""
    if cfg.trainable_tokens and rows is None:  # never a silent LoRA-only adapter when rows were asked for
        raise ConfigError(
            f"lora.trainable_tokens is {list(cfg.trainable_tokens)} but no token rows were given: "
            "the caller picks the ids whose rows train (features.id_buckets)"
        )
    rows = rows or {}
    extra = sorted(set(rows) - set(cfg.trainable_tokens))
    if extra:
        raise ConfigError(f"token rows for {extra}, but lora.trainable_tokens is {list(cfg.trainable_tokens)}")
    wide = getattr(base, "wide", None) is not None
    if cfg.kind == "delta" and not wide:
        raise ConfigError(
            "lora.kind delta moves the per-id rows of the base's wide term, and this base has none "
            "(model.wide: false); train the base with model.wide: true"
        )
    out = {}
    for table in cfg.trainable_tokens:
        picked = sorted({int(i) for i in rows.get(table, ())})
        if picked:
            if cfg.kind != "delta":
                out[f"embeddings.{table}"] = _embedding_rows(base, picked)
            if wide:
                out[f"wide.{table}"] = picked
    return out


def _embedding_rows(base: nn.Module, tokens: list[int]) -> list[int]:
    """An id's embedding row: its token, or modulo `id_buckets` when the wide tables have more rows
    (`model.wide_id_buckets`, features.token_sizes)."""
    mc = getattr(base, "cfg", None)
    if getattr(mc, "wide_id_buckets", 0):
        return sorted({i % mc.id_buckets for i in tokens})
    return tokens


def peft_config(
    cfg: LoraTrainConfig, token_indices: dict[str, list[int]] | None = None, layers: list[int] | None = None
):
    """PEFT's LoraConfig of `cfg`; `layers`: `cfg.layers` as non-negative indices (`layer_indices`)."""
    if cfg.layers and layers is None:
        raise ValueError("peft_config: lora.layers needs the model's indices (layer_indices)")
    return LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=target_names(cfg),
        bias="none",
        trainable_token_indices=token_indices or None,
        rank_pattern=dict(cfg.rank_pattern),
        layers_to_transform=layers or None,
        layers_pattern=list(LAYER_LISTS) if layers else None,
    )


def layer_indices(base: nn.Module, cfg: LoraTrainConfig) -> list[int]:
    """`cfg.layers` as indices of `base`'s layer list: a negative one counts from the top (-1: the top layer,
    whatever the model's depth), as in Python. An index past the model's layers is refused."""
    if not cfg.layers:
        return []
    pattern = re.compile(rf"\.(?:{'|'.join(LAYER_LISTS)})\.(\d+)\.")
    found = {
        int(m.group(1))
        for name, _ in base.named_modules()
        if name.split(".")[-1] in set(target_names(cfg)) and (m := pattern.search(f".{name}"))
    }
    depth = max(found) + 1 if found else 0
    bad = [i for i in cfg.layers if not -depth <= i < depth]
    if bad:
        raise ConfigError(
            f"lora.layers {bad}: the model's {list(cfg.target_modules)} sit in {depth} numbered layers "
            f"(indices 0..{depth - 1} or -{depth}..-1)"
            if depth
            else f"lora.layers {list(cfg.layers)}: no {list(cfg.target_modules)} module sits in a layer list "
            f"named one of {list(LAYER_LISTS)}"
        )
    return sorted({i % depth for i in cfg.layers})


def check_layers(model, layers: list[int], cfg: LoraTrainConfig, adapter_name: str = "default") -> None:
    """Every layer of `layers` must have a wrapped module (PEFT skips an index it finds no module in)."""
    wrapped = [name for name, m in model.named_modules() if hasattr(m, "lora_A") and adapter_name in m.lora_A]
    pattern = "|".join(LAYER_LISTS)
    missing = [i for i in layers if not any(re.search(rf"\.(?:{pattern})\.{i}\.", f".{n}") for n in wrapped)]
    if missing:
        raise ConfigError(
            f"lora.layers: layers {missing} have no {list(cfg.target_modules)} module (wrapped: {sorted(wrapped)})"
        )


def check_rank_pattern(model, cfg: LoraTrainConfig, adapter_name: str = "default") -> None:
    """Every `lora.rank_pattern` key must have matched a wrapped module (PEFT ignores a key that matches
    none, which would silently train that layer at `r`), and the ranks must be the ones asked for."""
    wrapped = {
        name.removeprefix("base_model.model."): m
        for name, m in model.named_modules()
        if hasattr(m, "lora_A") and (adapter_name in m.lora_A or adapter_name in m.lora_embedding_A)
    }
    for key, rank in cfg.rank_pattern.items():
        hits = [n for n in wrapped if n == key or n.endswith("." + key)]
        if not hits:
            raise ConfigError(
                f"lora.rank_pattern key {key!r} matches no module PEFT wrapped (wrapped: {sorted(wrapped)})"
            )
        got = {n: wrapped[n].r[adapter_name] for n in hits}
        if set(got.values()) != {rank}:
            raise ConfigError(f"lora.rank_pattern[{key!r}] = {rank}, but PEFT built ranks {got}")


# Why lora.stability_max defaults to 0.01 (measurements): docs/benchmarks.md, "LoRA learning-rate stability rule".
def stable_lr(cfg: LoraTrainConfig) -> dict:
    """Apply the stability rule: the lr to train with, the rule's value at the configured lr, and
    whether it was rescaled. "reject" configs never get here (LoraTrainConfig refuses them)."""
    lr = cfg.stable_lr()
    if lr != cfg.lr:
        log.warning(
            "lora: lr * r / sqrt(batch_size) = %.6g > stability_max %.6g: lr rescaled from %.6g to %.6g "
            "(stability_action=rescale)",
            cfg.stability,
            cfg.stability_max,
            cfg.lr,
            lr,
        )
    return {"effective_lr": lr, "stability": cfg.stability, "lr_rescaled": lr != cfg.lr}


def _layernorm_biases(base: nn.Module) -> dict[str, nn.Parameter]:
    return {f"{n}.bias": m.bias for n, m in base.named_modules() if isinstance(m, nn.LayerNorm) and m.bias is not None}


def attach(
    base: nn.Module, cfg: LoraTrainConfig, adapter_name: str = "default", token_rows: dict[str, list[int]] | None = None
):
    """Wrap `base` with a fresh LoRA adapter; only the adapter's A/B matrices train (and the
    LayerNorm biases when cfg.train_layernorm_bias, and the id rows `token_rows` of the tables of
    cfg.trainable_tokens, see `token_targets`; with cfg.tokens_only those rows alone).

    PEFT injects the LoRA layers into `base` in place, so pass a model you own (load a fresh base).
    """
    base.requires_grad_(False)
    tokens = token_targets(base, cfg, token_rows)
    layers = layer_indices(base, cfg)
    model = get_peft_model(base, peft_config(cfg, tokens, layers), adapter_name=adapter_name)
    check_rank_pattern(model, cfg, adapter_name)
    check_layers(model, layers, cfg, adapter_name)
    if cfg.tokens_only or cfg.kind == "delta":  # PEFT wants a LoRA target; its B matrices start at zero and stay there
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.requires_grad_(False)
    if cfg.train_layernorm_bias:
        for p in _layernorm_biases(model.get_base_model()).values():
            p.requires_grad_(True)
        setattr(model, _LN_FLAG, True)
    return model


def save(model, directory: str | Path) -> None:
    """PEFT's adapter files, plus the LayerNorm biases when they were trained with the adapter."""
    model.save_pretrained(str(directory))
    if getattr(model, _LN_FLAG, False):
        biases = _layernorm_biases(model.get_base_model())
        save_file(
            {k: v.detach().contiguous().clone() for k, v in biases.items()}, str(Path(directory) / LAYERNORM_BIAS_FILE)
        )


def load(base: nn.Module, adapter_dir: str, adapter_name: str = "default"):
    """Load an adapter onto `base` (modified in place), frozen and in eval mode."""
    model = PeftModel.from_pretrained(base, adapter_dir, adapter_name=adapter_name, is_trainable=False)
    extra = Path(adapter_dir) / LAYERNORM_BIAS_FILE
    if extra.is_file():
        biases, saved = _layernorm_biases(model.get_base_model()), load_file(str(extra))
        if set(saved) != set(biases):
            raise ValueError(f"{extra} holds biases {sorted(saved)}, the base has {sorted(biases)}")
        with torch.no_grad():
            for k, v in saved.items():
                biases[k].copy_(v)
        setattr(model, _LN_FLAG, True)
    return model.eval()


def trainable_fraction(model: nn.Module) -> dict:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return {"trainable_params": trainable, "total_params": total, "trainable_fraction": trainable / max(total, 1)}
