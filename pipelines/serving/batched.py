"""Mixed-adapter LoRA in one forward pass: every row gets its own adapter, in a few batched ops.

PEFT loads and keeps the adapters on a *store* module tree (a PeftModel that never runs a forward).
Serving runs a plain module tree of the base, sharing its weight tensors, in which every layer some
served adapter targets has a forward hook that adds

    Linear:    y += (x @ A^T[i]) @ (sB)^T[i]        A^T: [n+1, d_in, r],  (sB)^T: [n+1, r, d_out]
    Embedding: y += A^T[i, token] @ (sB)^T[i]       A^T: [n+1, V, r] (stored flat: [(n+1) * V, r])
    Tokens:    y += D[M[i * V + token]]            D: [1 + sum_i k_i, d],  M: [(n+1) * V] int32

where `i` is the row's adapter index (0 = a zero adapter, for rows on the base), r is padded to the
largest rank with zeros and s is PEFT's scaling (alpha / r, or rsLoRA's).

The token term serves PEFT's trainable tokens (`LoraConfig(trainable_token_indices=...)` on an
`embeddings.<f>` or `wide.<f>` table). PEFT keeps adapter i's k_i rows as absolute values
(`trainable_tokens_delta`) that replace the table's rows at its indices; D holds them minus the base
rows there (row 0: zeros) and M maps (adapter, token) to that row of D (0: a token the adapter does
not change). A table gets LoRA or tokens, never both: PEFT refuses to put both on one module (within
one adapter, and across the adapters of one store, where the second load fails).

Anything else PEFT can put in a model (modules_to_save, other tuners, LoRA variants, adapter tensors
of a kind not listed above) is reported by `unsupported`, and the caller must refuse the adapter:
serving it would silently leave that part out.

Stacks and tree belong to one routing table and never change after it is built (a new set of
targeted layers gets a new tree), so a forward pass reads nothing a refresh modifies; the cost is one
gather and two batched matmuls per LoRA layer, two gathers and an add per token table, whatever the
number of adapters in the batch, and untargeted layers run hook-free.
"""

from __future__ import annotations

import contextvars
import copy
import itertools
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
from peft import PeftModel
from peft.tuners.lora import Embedding, Linear, LoraLayer
from peft.tuners.trainable_tokens import TrainableTokensLayer
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils.other import AuxiliaryTrainingWrapper, TrainableTokensWrapper
from torch import nn

_REQUEST: contextvars.ContextVar[tuple[dict, torch.Tensor] | None] = contextvars.ContextVar(
    "ctr_serving_request", default=None
)


@dataclass(frozen=True)
class LayerStack:
    """Stacked LoRA weights of one layer, laid out for `index_select` + batched matmul; row 0 (of
    each adapter axis) is the zero adapter."""

    embedding: bool
    a: torch.Tensor  # Linear: A^T [n+1, d_in, r]; Embedding: A^T flattened [(n+1) * V, r]
    b: torch.Tensor  # (s * B)^T [n+1, r, d_out]
    vocab: int = 0  # V, for Embedding

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


@dataclass(frozen=True)
class TokenStack:
    """Trainable-token rows of one Embedding table over the served adapters, as offsets from the base
    rows: `rows` D [1 + sum k_i, d] (row 0 = zeros) and `index` M [(n+1) * V] int32, row of D for
    (adapter i, token v) at i * V + v. int32 because M is the big part: (n+1) * V entries."""

    rows: torch.Tensor
    index: torch.Tensor
    vocab: int

    def add_delta(self, output: torch.Tensor, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """`output` [batch, ..., d] + each row's token offset (zero outside its adapter's indices)."""
        n = rows.shape[0]
        idx = (rows.view(n, *([1] * (x.dim() - 1))) * self.vocab + x).reshape(-1)
        return output + self.rows.index_select(0, self.index.index_select(0, idx)).view(output.shape)


def hookable(model: nn.Module) -> set[str]:
    """Names of the layers `serving_tree` can hook (what an adapter may target)."""
    return {n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))}


def lora_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            yield name, module


def token_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(table name, TrainableTokensLayer). The table name is the one the plain base gives the wrapped
    Embedding, i.e. the serving tree's hook name: LoRA's `trainable_token_indices` put the layer at
    `<table>.token_adapter` inside a TrainableTokensWrapper; a TrainableTokensConfig model puts it at
    `<table>` itself."""
    for name, module in model.named_modules():
        if isinstance(module, TrainableTokensLayer):
            yield name.removesuffix(".token_adapter"), module


def unsupported(store: nn.Module, adapter: str, hooked: set[str]) -> list[str]:
    """What `build_stacks` cannot compute for `adapter` of the store model (DoRA and other variants,
    LoRA biases, layers other than Linear / Embedding, a layer the serving model has no hook on, tokens
    on anything but a plain Embedding, modules_to_save and any other PEFT wrapper or tuner, any adapter
    tensor of an unknown kind). Empty = every part of the adapter is served; otherwise refuse it, since
    serving would silently leave the listed parts out."""
    found = [
        *_lora_problems(store, adapter, hooked),
        *_token_problems(store, adapter, hooked),
        *_foreign_problems(store, adapter),
    ]
    flagged = {name for name, _ in found}
    found += _stray_tensors(store, adapter, flagged)
    return sorted({problem for _, problem in found})


def _lora_problems(store: nn.Module, adapter: str, hooked: set[str]) -> list[tuple[str, str]]:
    problems = []
    for name, layer in lora_layers(store):
        if adapter not in layer.lora_A and adapter not in layer.lora_embedding_A:
            continue
        if name not in hooked:
            problems.append((name, f"{name} is not a Linear or Embedding of the base"))
        if not isinstance(layer, (Linear, Embedding)):
            problems.append((name, f"{name} is a {type(layer).__name__} LoRA layer"))
        if adapter in getattr(layer, "lora_variant", {}):
            problems.append((name, f"{name} uses the {type(layer.lora_variant[adapter]).__name__} variant"))
        if adapter in layer.lora_B and layer.lora_B[adapter].bias is not None:
            problems.append((name, f"{name} has a LoRA bias"))
    return problems


def _token_problems(store: nn.Module, adapter: str, hooked: set[str]) -> list[tuple[str, str]]:
    problems = []
    for table, layer in token_layers(store):
        if adapter not in layer.trainable_tokens_delta:
            continue
        base = layer.get_base_layer()
        if table not in hooked:
            problems.append((table, f"{table} (trainable tokens) is not a Linear or Embedding of the base"))
        # A tied layer (an LM head sharing the input embedding) would need the transposed term, and
        # max_norm / embed_scale change the looked-up rows: the token term assumes a plain lookup.
        if layer.tied_adapter is not None:
            problems.append((table, f"{table} has trainable tokens tied to another layer"))
        if not isinstance(base, nn.Embedding) or base.max_norm is not None or hasattr(base, "embed_scale"):
            problems.append(
                (
                    table,
                    f"{table} has trainable tokens on a {type(base).__name__} that is not a plain nn.Embedding lookup",
                )
            )
        indices = list(layer.token_indices[adapter])
        if len(set(indices)) != len(indices):
            # PEFT's own index_copy with repeated indices is nondeterministic: nothing to match
            problems.append((table, f"{table} has repeated trainable token indices"))
    return problems


def _foreign_problems(store: nn.Module, adapter: str) -> list[tuple[str, str]]:
    """PEFT wrappers (ModulesToSaveWrapper, ...) and tuner layers other than LoRA / trainable tokens
    that hold `adapter`: their output replaces or changes the module's, which no stack computes."""
    problems = []
    for name, module in store.named_modules():
        if isinstance(module, AuxiliaryTrainingWrapper) and not isinstance(module, TrainableTokensWrapper):
            if adapter in _wrapper_adapters(module):
                kind = module._error_message_name()
                problems.append(
                    (
                        name,
                        f"{name} is replaced by a {type(module).__name__} ({kind}), which batched "
                        "serving does not compute",
                    )
                )
        elif isinstance(module, BaseTunerLayer) and not isinstance(module, (LoraLayer, TrainableTokensLayer)):
            if any(adapter in getattr(module, attr, {}) for attr in module.adapter_layer_names):
                problems.append((name, f"{name} is a {type(module).__name__} adapter layer"))
    return problems


def _wrapper_adapters(module: nn.Module) -> set[str]:
    try:
        return set(module._get_available_adapters()) | set(module._adapters)
    except NotImplementedError:  # a wrapper that does not say: its own adapter set
        return set(module._adapters)


def _stray_tensors(store: nn.Module, adapter: str, flagged: set[str]) -> list[tuple[str, str]]:
    """Catch-all: every parameter or buffer PEFT keys by `adapter` must be one the stacks read, so a
    kind of adapter state this module does not know is refused rather than silently dropped. Tensors
    under an already reported module are left out (one message per cause)."""
    a = re.escape(adapter)
    served = re.compile(
        rf"\.(?:lora_A\.{a}\.weight|lora_B\.{a}\.(?:weight|bias)|lora_embedding_[AB]\.{a}"
        rf"|trainable_tokens_(?:delta|original)\.{a})$"
    )
    problems = []
    for name, _ in itertools.chain(store.named_parameters(), store.named_buffers()):
        if (
            adapter in name.split(".")
            and not served.search(name)
            and not any(name.startswith(f + ".") for f in flagged)
        ):
            problems.append((name, f"{name} is adapter state batched serving does not compute"))
    return problems


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
            a_all[i, :, : a.shape[1]] = a
            b_all[i, : b.shape[0], :] = b
    if embedding:
        return LayerStack(True, a_all.reshape(-1, rank).contiguous(), b_all, vocab=rows_in)
    return LayerStack(False, a_all, b_all)


def _token_stack(layer, adapters: Sequence[str]) -> TokenStack | None:
    """The TokenStack of one TrainableTokensLayer over `adapters` (M row i = adapters[i-1]), or None
    when none of them has tokens there. The offsets are taken against the base rows the serving tree
    looks up (not PEFT's `trainable_tokens_original` copy), so base + offset is exactly PEFT's row."""
    weight = layer.get_base_layer().weight.detach()
    index = torch.zeros(len(adapters) + 1, weight.shape[0], dtype=torch.int32)
    parts, count = [weight.new_zeros(1, weight.shape[1])], 1
    for i, adapter in enumerate(adapters, start=1):
        if adapter not in layer.trainable_tokens_delta:
            continue
        ids = torch.as_tensor(list(layer.token_indices[adapter]), dtype=torch.long)
        parts.append(layer.trainable_tokens_delta[adapter].detach().to(weight) - weight.index_select(0, ids))
        index[i, ids] = torch.arange(count, count + len(ids), dtype=torch.int32)
        count += len(ids)
    if count == 1:
        return None
    return TokenStack(torch.cat(parts).contiguous(), index.reshape(-1), vocab=weight.shape[0])


@torch.no_grad()
def build_stacks(store: nn.Module, adapters: Sequence[str]) -> dict[str, LayerStack | TokenStack]:
    """{layer name: LayerStack or TokenStack} over the store's `adapters` (stack row i+1 = adapters[i]);
    layers none of them touch are left out. Check each adapter with `unsupported` first: this reads
    only the LoRA and trainable-token weights."""
    out: dict[str, LayerStack | TokenStack] = {}
    for name, layer in lora_layers(store):
        embedding = isinstance(layer, Embedding)
        weights = _embedding_weights if embedding else _linear_weights
        pairs = [weights(layer, a) for a in adapters]
        if any(p is not None for p in pairs):
            out[name] = _stack(pairs, embedding)
    for table, layer in token_layers(store):
        stack = _token_stack(layer, adapters)
        if stack is None:
            continue
        if table in out:  # PEFT cannot build such a store today; one hook adds one stack's term
            raise ValueError(f"{table} has both LoRA and trainable tokens in the store")
        out[table] = stack
    return out


def load_adapter(peft, store: nn.Module, adapter_dir: str, name: str):
    """Load the adapter in `adapter_dir` into the store as `name`, frozen: a new PeftModel on `store`
    when `peft` is None, else into `peft`; returns the PeftModel.

    Use this rather than PEFT's `load_adapter` once the store may hold trainable tokens. PEFT 0.21.2's
    `set_peft_model_state_dict` asks every TrainableTokensWrapper in the model for the loaded adapter's
    keys, and a wrapper the adapter has no tokens on (another adapter's table, or one left empty by a
    deleted adapter) raises KeyError: after one token adapter, no adapter without tokens on exactly
    the same tables would load. ModulesToSaveWrapper answers {} for an adapter it does not hold; here
    the store's wrappers are made to do the same for the duration of the load.
    """
    if peft is None:
        return PeftModel.from_pretrained(store, adapter_dir, adapter_name=name, is_trainable=False)
    with _token_wrappers_skip_other_adapters(store):
        peft.load_adapter(adapter_dir, adapter_name=name, is_trainable=False)
    return peft


@contextmanager
def _token_wrappers_skip_other_adapters(store: nn.Module) -> Iterator[None]:
    """Per instance, not on PEFT's class: nothing outside this store (another thread's model) changes."""
    wrappers = [m for m in store.modules() if isinstance(m, TrainableTokensWrapper)]
    for wrapper in wrappers:
        wrapper.adapter_state_dict_load_map = partial(_own_load_map, wrapper)
    try:
        yield
    finally:
        for wrapper in wrappers:
            del wrapper.adapter_state_dict_load_map


def _own_load_map(wrapper, adapter_name: str) -> dict[str, str]:
    if adapter_name not in wrapper._adapters:
        return {}
    return type(wrapper).adapter_state_dict_load_map(wrapper, adapter_name)


def _add_delta(layer_name: str, module, args, output):
    request = _REQUEST.get()
    if request is None:
        return None
    stacks, rows = request
    stack = stacks.get(layer_name)
    return None if stack is None else stack.add_delta(output, args[0], rows)


def serving_tree(base: nn.Module, layers: frozenset[str]) -> nn.Module:
    """A module tree of `base` sharing its tensors, with the adapter hook on `layers` (it adds the term
    of whichever stack, LoRA or tokens, the request has for the layer). A new tree, so no module a
    running forward uses ever gets a hook added or removed."""
    if not layers:
        return base
    tree = copy.deepcopy(base, {id(t): t for t in (*base.parameters(), *base.buffers())})
    for name, layer in tree.named_modules():
        if name in layers:
            layer.register_forward_hook(partial(_add_delta, name))
    return tree.eval()


@contextmanager
def request(stacks: dict[str, LayerStack | TokenStack], rows: torch.Tensor) -> Iterator[None]:
    """Within this block (this thread / context only), forward passes add each row's adapter term."""
    token = _REQUEST.set((stacks, rows))
    try:
        yield
    finally:
        _REQUEST.reset(token)
