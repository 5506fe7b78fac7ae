"""The orthogonality penalty between sibling slot adapters (issue 14, item 4; `lora.orthogonality_lambda`).

The loss of a slot adapter gains lambda * sum_j sum_m ||dW_m^T dW_{j,m}||_F: m runs over the target
modules both adapters wrap, j over the serving champions of the other slots (fixed while it trains).
||dW^T dW_j||_F is zero exactly when the column spaces of the two updates are orthogonal, so the
penalty pushes an adapter away from what its siblings already change. Unlike a cosine it also falls
as dW shrinks; lambda trades that against the data.

Every update is handled in low-rank form, dW = P @ Q in the weight's own shape ([out, in] for a
Linear, [vocab, dim] for an Embedding), so dW^T dW_j = Q^T (P^T P_j) Q_j and its squared norm is a
sum over r x r matrices: the cost does not grow with the layer's width (a 16,384-row id table costs
two r x vocab products, not a vocab x vocab one).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from pipelines.errors import PipelineError

Factors = dict[str, tuple[torch.Tensor, torch.Tensor]]  # module -> (P, Q), dW = P @ Q
_PREFIX = "base_model.model."
_EPS = 1e-20  # under the square root: its gradient stays finite where the product is zero (B starts at 0)


def live_factors(model: nn.Module, adapter: str = "default") -> Factors:
    """(P, Q) of every LoRA layer of `adapter` in a PEFT model, with their autograd history."""
    out: Factors = {}
    for name, m in model.named_modules():
        if not hasattr(m, "lora_A"):
            continue
        module = name.removeprefix(_PREFIX)
        if adapter in m.lora_A:
            out[module] = (m.lora_B[adapter].weight * m.scaling[adapter], m.lora_A[adapter].weight)
        elif adapter in m.lora_embedding_A:
            out[module] = (m.lora_embedding_A[adapter].T, (m.lora_embedding_B[adapter] * m.scaling[adapter]).T)
    return out


def saved_factors(adapter_dir: str | Path) -> Factors:
    """(P, Q) of every LoRA layer of an adapter saved by PEFT (adapter_model.safetensors and
    adapter_config.json: the scale is lora_alpha / r of each layer, or / sqrt(r) with rsLoRA)."""
    d = Path(adapter_dir)
    try:
        conf = json.loads((d / "adapter_config.json").read_text())
        tensors = load_file(str(d / "adapter_model.safetensors"))
    except (OSError, ValueError) as exc:
        raise PipelineError(f"orthogonality: cannot read the adapter at {d}: {exc}") from exc
    if conf.get("alpha_pattern"):
        raise PipelineError(f"orthogonality: {d} has an alpha_pattern, which this penalty does not read")
    out: Factors = {}
    for key, a in tensors.items():
        for a_suffix, b_suffix, embedding in (
            (".lora_A.weight", ".lora_B.weight", False),
            (".lora_embedding_A", ".lora_embedding_B", True),
        ):
            if not key.endswith(a_suffix):
                continue
            module = key[: -len(a_suffix)]
            b = tensors[module + b_suffix].float()
            a = a.float()
            r = a.shape[0]
            scale = conf["lora_alpha"] / (r**0.5 if conf.get("use_rslora") else r)
            out[module.removeprefix(_PREFIX)] = (a.T, (b * scale).T) if embedding else (b * scale, a)
    if not out:
        raise PipelineError(f"orthogonality: {d} holds no LoRA matrices")
    return out


def _squared_cross_norm(fi: tuple[torch.Tensor, torch.Tensor], fj: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """||(P_i Q_i)^T (P_j Q_j)||_F^2 = sum(M * (G_i M H_j)), M = P_i^T P_j, G_i = Q_i Q_i^T, H_j = Q_j Q_j^T."""
    (pi, qi), (pj, qj) = fi, fj
    m = pi.T @ pj
    return (m * (qi @ qi.T @ m @ (qj @ qj.T))).sum()


def _inner(fi, fj) -> torch.Tensor:
    """<dW_i, dW_j> (the Frobenius inner product) = sum((P_i^T P_j) * (Q_i Q_j^T))."""
    (pi, qi), (pj, qj) = fi, fj
    return ((pi.T @ pj) * (qi @ qj.T)).sum()


def _shared(candidate: Factors, sibling: Factors, who: str) -> list[str]:
    modules = sorted(set(candidate) & set(sibling))
    for m in modules:
        shapes = [(f[m][0].shape[0], f[m][1].shape[1]) for f in (candidate, sibling)]
        if shapes[0] != shapes[1]:
            raise PipelineError(f"orthogonality: module {m} updates a {shapes[0]} weight here but {shapes[1]} in {who}")
    return modules


def penalty(candidate: Factors, siblings: dict[str, Factors]) -> torch.Tensor:
    """sum_j sum_m ||dW_m^T dW_{j,m}||_F (without lambda); differentiable in the candidate's factors."""
    total = torch.zeros(())
    for who, sib in siblings.items():
        for m in _shared(candidate, sib, who):
            total = total + torch.sqrt(_squared_cross_norm(candidate[m], sib[m]) + _EPS)
    return total


def max_abs_cos(candidate: Factors, siblings: dict[str, Factors]) -> float | None:
    """The largest |cos| between the candidate's update and a sibling's, over shared modules (as
    evaluation.interference measures saved adapters); None when no pair has two non-zero updates."""
    best = None
    with torch.no_grad():
        for who, sib in siblings.items():
            for m in _shared(candidate, sib, who):
                ni, nj = _inner(candidate[m], candidate[m]), _inner(sib[m], sib[m])
                if float(ni) <= 0.0 or float(nj) <= 0.0:
                    continue
                c = min(abs(float(_inner(candidate[m], sib[m]))) / float(torch.sqrt(ni * nj)), 1.0)
                best = c if best is None else max(best, c)
    return best


def update_norm(factors: Factors) -> float:
    """||dW||_F over all modules together: how far the adapter moves its base (the penalty shrinks it too)."""
    with torch.no_grad():
        return float(torch.sqrt(sum((_inner(f, f) for f in factors.values()), torch.zeros(()))))


class Regularizer:
    """What `training.loop.fit` adds to each batch's loss: lambda * `penalty` against fixed siblings."""

    def __init__(self, lam: float, siblings: dict[str, Factors], adapter: str = "default") -> None:
        self.lam, self.adapter = float(lam), adapter
        self.siblings = {who: {m: (p.detach(), q.detach()) for m, (p, q) in f.items()} for who, f in siblings.items()}

    def __call__(self, model: nn.Module) -> torch.Tensor:
        return self.lam * penalty(live_factors(model, self.adapter), self.siblings)

    def report(self, model: nn.Module) -> dict:
        """JSON-safe: lambda, the siblings, the penalty's value (without lambda) and the largest |cos| now."""
        with torch.no_grad():
            live = live_factors(model, self.adapter)
            value = float(penalty(live, self.siblings))
        return {
            "lambda": self.lam,
            "siblings": sorted(self.siblings),
            "penalty": value,
            "max_abs_cos": max_abs_cos(live, self.siblings),
        }
