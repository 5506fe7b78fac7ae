"""LoRA adapters (HF PEFT) on the frozen base model. Targets are named explicitly.

Besides PEFT's LoRA matrices an adapter may carry the LayerNorm biases of the base
(`lora.train_layernorm_bias`). PEFT has no "LayerNorm biases only" option (`bias="all"` trains
every Linear bias too, `modules_to_save` copies whole modules), so `attach` un-freezes them in
place and `save`/`load` keep them in `layernorm_bias.safetensors` next to PEFT's files.
Consequence: `disable_adapter()` switches the LoRA matrices off but not those biases.
"""
from __future__ import annotations

import logging
from pathlib import Path

from torch import nn

from pipelines.config import LoraTrainConfig
from pipelines.data.schema import FEATURE_FIELDS

log = logging.getLogger(__name__)

LAYERNORM_BIAS_FILE = "layernorm_bias.safetensors"
_LN_FLAG = "_ctr_layernorm_bias"   # set on the PeftModel when its LayerNorm biases belong to the adapter


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


def peft_config(cfg: LoraTrainConfig):
    from peft import LoraConfig

    return LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                      target_modules=target_names(cfg), bias="none")


# Why lora.stability_max defaults to 0.01 (measurements): docs/benchmarks.md, "LoRA learning-rate stability rule".
def stable_lr(cfg: LoraTrainConfig) -> dict:
    """Apply the stability rule: the lr to train with, the rule's value at the configured lr, and
    whether it was rescaled. "reject" configs never get here (LoraTrainConfig refuses them)."""
    lr = cfg.stable_lr()
    if lr != cfg.lr:
        log.warning("lora: lr * r / sqrt(batch_size) = %.6g > stability_max %.6g: lr rescaled from %.6g to %.6g "
                    "(stability_action=rescale)", cfg.stability, cfg.stability_max, cfg.lr, lr)
    return {"effective_lr": lr, "stability": cfg.stability, "lr_rescaled": lr != cfg.lr}


def _layernorm_biases(base: nn.Module) -> dict[str, nn.Parameter]:
    return {f"{n}.bias": m.bias for n, m in base.named_modules()
            if isinstance(m, nn.LayerNorm) and m.bias is not None}


def attach(base: nn.Module, cfg: LoraTrainConfig, adapter_name: str = "default"):
    """Wrap `base` with a fresh LoRA adapter; only the adapter's A/B matrices train (and the
    LayerNorm biases when cfg.train_layernorm_bias).

    PEFT injects the LoRA layers into `base` in place, so pass a model you own (load a fresh base).
    """
    from peft import get_peft_model

    base.requires_grad_(False)
    model = get_peft_model(base, peft_config(cfg), adapter_name=adapter_name)
    if cfg.train_layernorm_bias:
        for p in _layernorm_biases(model.get_base_model()).values():
            p.requires_grad_(True)
        setattr(model, _LN_FLAG, True)
    return model


def save(model, directory: str | Path) -> None:
    """PEFT's adapter files, plus the LayerNorm biases when they were trained with the adapter."""
    from safetensors.torch import save_file

    model.save_pretrained(str(directory))
    if getattr(model, _LN_FLAG, False):
        biases = _layernorm_biases(model.get_base_model())
        save_file({k: v.detach().contiguous().clone() for k, v in biases.items()},
                  str(Path(directory) / LAYERNORM_BIAS_FILE))


def load(base: nn.Module, adapter_dir: str, adapter_name: str = "default"):
    """Load an adapter onto `base` (modified in place), frozen and in eval mode."""
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file

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
