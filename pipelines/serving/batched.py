"""Mixed-adapter LoRA in one forward pass: every row gets its own adapter, in a few batched ops.

PEFT loads and keeps the adapters on a *store* module tree (a PeftModel that never runs a forward).
Serving runs a plain module tree of the base, sharing its weight tensors, in which every layer some
served adapter targets has a forward hook that adds

    Linear:    y += (x @ A^T[i]) @ (sB)^T[i]        A^T: [n+1, d_in, r],  (sB)^T: [n+1, r, d_out]
    Embedding: y += A^T[i, token] @ (sB)^T[i]       A^T: [n+1, V, r] (stored flat: [(n+1) * V, r])

where `i` is the row's adapter index (0 = a zero adapter, for rows on the base), r is padded to the
largest rank with zeros and s is PEFT's scaling (alpha / r, or rsLoRA's). Stacks and tree belong to
one routing table and never change after it is built (a new set of targeted layers gets a new tree),
so a forward pass reads nothing a refresh modifies; the cost is one gather and two batched matmuls per
targeted layer whatever the number of adapters in the batch, and untargeted layers run hook-free.
"""
from __future__ import annotations

import contextvars
import copy
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

_REQUEST: contextvars.ContextVar[tuple[dict, torch.Tensor] | None] = contextvars.ContextVar(
    "ctr_serving_request", default=None)


@dataclass(frozen=True)
class LayerStack:
    """Stacked LoRA weights of one layer, laid out for `index_select` + batched matmul; row 0 (of
    each adapter axis) is the zero adapter."""
    embedding: bool
    a: torch.Tensor   # Linear: A^T [n+1, d_in, r]; Embedding: A^T flattened [(n+1) * V, r]
    b: torch.Tensor   # (s * B)^T [n+1, r, d_out]
    vocab: int = 0    # V, for Embedding

    def add_delta(self, output: torch.Tensor, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """`output` + each row's LoRA term, as one fused multiply-add."""
        n = rows.shape[0]
        b = self.b.index_select(0, rows)
        if self.embedding:
            idx = (rows.view(n, *([1] * (x.dim() - 1))) * self.vocab + x).reshape(-1)
            after_a = self.a.index_select(0, idx).view(n, -1, self.a.shape[1])
        else:
            after_a = torch.bmm(x.reshape(n, -1, x.shape[-1]), self.a.index_select(0, rows))
        return torch.baddbmm(output.reshape(n, after_a.shape[1], -1), after_a, b).reshape(output.shape)


def hookable(model: nn.Module) -> set[str]:
    """Names of the layers `serving_tree` can hook (what an adapter may target)."""
    return {n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))}


def lora_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            yield name, module


def unsupported(store: nn.Module, adapter: str, hooked: set[str]) -> list[str]:
    """What `delta` cannot compute for `adapter` of the store model (DoRA and other variants, LoRA
    biases, layers other than Linear / Embedding, a layer the serving model has no hook on)."""
    from peft.tuners.lora import Embedding, Linear

    problems = set()
    for name, layer in lora_layers(store):
        if adapter not in layer.lora_A and adapter not in layer.lora_embedding_A:
            continue
        if name not in hooked:
            problems.add(f"{name} is not a Linear or Embedding of the base")
        if not isinstance(layer, (Linear, Embedding)):
            problems.add(f"{name} is a {type(layer).__name__} LoRA layer")
        if adapter in getattr(layer, "lora_variant", {}):
            problems.add(f"{name} uses the {type(layer.lora_variant[adapter]).__name__} variant")
        if adapter in layer.lora_B and layer.lora_B[adapter].bias is not None:
            problems.add(f"{name} has a LoRA bias")
    return sorted(problems)


def _linear_weights(layer, adapter: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(A^T [d_in, r], (s * B)^T [r, d_out]) or None when the adapter does not target the layer."""
    if adapter not in layer.lora_A:
        return None
    return layer.lora_A[adapter].weight.T, (layer.lora_B[adapter].weight * layer.scaling[adapter]).T


def _embedding_weights(layer, adapter: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(A^T [V, r], (s * B)^T [r, d]) or None."""
    if adapter not in layer.lora_embedding_A:
        return None
    return layer.lora_embedding_A[adapter].T, (layer.lora_embedding_B[adapter] * layer.scaling[adapter]).T


def _stack(pairs: list[tuple[torch.Tensor, torch.Tensor] | None], embedding: bool) -> LayerStack:
    present = [p for p in pairs if p is not None]
    rank = max(a.shape[1] for a, _ in present)
    rows_in, cols_out = present[0][0].shape[0], present[0][1].shape[1]
    a_all = torch.zeros(len(pairs) + 1, rows_in, rank)
    b_all = torch.zeros(len(pairs) + 1, rank, cols_out)
    for i, pair in enumerate(pairs, start=1):
        if pair is not None:
            a, b = pair
            a_all[i, :, :a.shape[1]] = a
            b_all[i, :b.shape[0], :] = b
    if embedding:
        return LayerStack(True, a_all.reshape(-1, rank).contiguous(), b_all, vocab=rows_in)
    return LayerStack(False, a_all, b_all)


@torch.no_grad()
def build_stacks(store: nn.Module, adapters: Sequence[str]) -> dict[str, LayerStack]:
    """{layer name: LayerStack} over the store's `adapters` (stack row i+1 = adapters[i]); layers none of
    them touch are left out."""
    from peft.tuners.lora import Embedding

    out = {}
    for name, layer in lora_layers(store):
        embedding = isinstance(layer, Embedding)
        weights = _embedding_weights if embedding else _linear_weights
        pairs = [weights(layer, a) for a in adapters]
        if any(p is not None for p in pairs):
            out[name] = _stack(pairs, embedding)
    return out


def _add_delta(layer_name: str, module, args, output):
    request = _REQUEST.get()
    if request is None:
        return None
    stacks, rows = request
    stack = stacks.get(layer_name)
    return None if stack is None else stack.add_delta(output, args[0], rows)


def serving_tree(base: nn.Module, layers: frozenset[str]) -> nn.Module:
    """A module tree of `base` sharing its tensors, with the LoRA hook on `layers` (a new tree, so no
    module a running forward uses ever gets a hook added or removed)."""
    if not layers:
        return base
    tree = copy.deepcopy(base, {id(t): t for t in (*base.parameters(), *base.buffers())})
    for name, layer in tree.named_modules():
        if name in layers:
            layer.register_forward_hook(partial(_add_delta, name))
    return tree.eval()


@contextmanager
def request(stacks: dict[str, LayerStack], rows: torch.Tensor) -> Iterator[None]:
    """Within this block (this thread / context only), forward passes add each row's adapter term."""
    token = _REQUEST.set((stacks, rows))
    try:
        yield
    finally:
        _REQUEST.reset(token)
