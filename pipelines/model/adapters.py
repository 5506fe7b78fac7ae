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

STABILITY_EVIDENCE = """Why lora.stability_max defaults to 0.01 (the rule: lr * r / sqrt(batch_size) <= 0.01).

This model cannot blow up to NaN under LoRA: pre-norm blocks, a final LayerNorm before the frozen
head and AdamW's bounded steps keep the logits finite. Too large a step shows instead as the adapter
wrecking the base's ranking: AUC falls to or below the base's (towards 0.5) while logloss barely
moves. Measured (3 epochs, AdamW, warm-up 10, cosine decay; holdout = newest 20 % of the window):

* synthetic ad logs (default SyntheticSpec, 200k-row day, `feed` slot: 86k train rows), default
  ModelConfig, base trained 2 epochs on an earlier day, LoRA q/v r=8 batch 256, seeds 1 / 2.
  Base holdout AUC 0.560. stability 0.0025 (the shipped lr 5e-3): 0.617 / 0.620; 0.01: 0.621 /
  0.614; 0.025: 0.604 / 0.602; 0.05: 0.609 / 0.594; 0.25: 0.538 / 0.566 (the adapter's gain is gone).
  At 100k rows (seed 7) 0.025-1.0 collapse to 0.49-0.58 while 0.0025-0.015 hold 0.609-0.613.
* the tiny setup of tests/pipelines/training/test_stability.py (r=8, batch 64, base val AUC 0.606):
  seeds 1 / 2, final val AUC: stability <= 0.02 gives 0.657-0.670, 0.05-0.1 gives 0.637-0.648,
  0.2-3.0 gives 0.49-0.58 in 7 of 8 runs (0.651 in one).
* MovieLens-100K (base on ratings up to 1998-01-31; adapter on Feb-Apr 1998, 23.8k train rows; base
  holdout AUC 0.686): q/v adapters stay within 0.67-0.69 up to stability 0.5 (no collapse); with
  embeddings + LayerNorm biases: 0.679-0.689 up to 0.05, 0.653 at 0.1, 0.559 at 0.25, 0.535 at 0.5.

0.01 is the largest value at which no setting lost anything against the shipped 0.0025 (4x headroom
for the shipped configs); from 0.025 up the synthetic adapters lose AUC. The r factor of the rule is
conservative: with alpha fixed the LoRA scale is alpha / r, and r=32 at stability 0.05 still held
(0.605) while r=4 / batch 64 at 0.01 was the weakest point tested (0.587 on the 100k-row day).
"""


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
