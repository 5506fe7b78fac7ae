"""LoRA adapters (HF PEFT) on the frozen base model. Targets are named explicitly."""
from __future__ import annotations

from torch import nn

from pipelines.config import LoraTrainConfig


def peft_config(cfg: LoraTrainConfig):
    from peft import LoraConfig

    return LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                      target_modules=list(cfg.target_modules), bias="none")


def attach(base: nn.Module, cfg: LoraTrainConfig, adapter_name: str = "default"):
    """Wrap `base` with a fresh LoRA adapter; only the adapter's A/B matrices train.

    PEFT injects the LoRA layers into `base` in place, so pass a model you own (load a fresh base).
    """
    from peft import get_peft_model

    base.requires_grad_(False)
    model = get_peft_model(base, peft_config(cfg), adapter_name=adapter_name)
    return model


def load(base: nn.Module, adapter_dir: str, adapter_name: str = "default"):
    from peft import PeftModel

    model = PeftModel.from_pretrained(base, adapter_dir, adapter_name=adapter_name, is_trainable=False)
    return model.eval()


def trainable_fraction(model: nn.Module) -> dict:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return {"trainable_params": trainable, "total_params": total, "trainable_fraction": trainable / max(total, 1)}
