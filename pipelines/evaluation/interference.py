"""Interference between LoRA adapters of one base: how aligned their weight updates are.

Per target module, an adapter's update is dW = B @ A (PEFT's lora_B [out, r] times lora_A [r, in];
for embedding tables lora_embedding_B @ lora_embedding_A, the transpose of the table update, which
leaves every cosine unchanged). Two adapters whose flattened dW have |cos| near 1 push the same
weights along the same (or the opposite) direction: serving or merging them together interferes.

The LoRA scaling alpha / r multiplies dW by a positive constant, and |cos| is scale invariant, so
scalings are optional (only the returned norms depend on them). An untrained adapter has B = 0,
hence dW = 0 and no direction: its cosines are None. LayerNorm biases saved next to an adapter
(model.adapters) are not LoRA matrices and are ignored.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from pipelines.metrics import EvaluationInputError

ADAPTER_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
# saved files: `<module>.lora_A.weight`, `<module>.lora_embedding_A`; in-memory state dicts carry the
# adapter name too: `<module>.lora_A.<name>.weight`, `<module>.lora_embedding_A.<name>`
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?:embedding_)?(?P<ab>[AB])(?:\.(?!weight$)(?P<name>[^.]+))?(?:\.weight)?$")


def load_adapter(source) -> dict:
    """A state dict as given, or read from a directory holding adapter_model.safetensors (or the file)."""
    if isinstance(source, Mapping):
        return dict(source)
    path = Path(source)
    if path.is_dir():
        path = path / ADAPTER_FILE
    if not path.is_file():
        raise EvaluationInputError(
            f"interference: no adapter at {path} (expected a state dict, a directory "
            f"with {ADAPTER_FILE}, or the file itself)"
        )

    return load_file(str(path))


def _as_numpy(t) -> np.ndarray:
    if hasattr(t, "detach"):  # a torch tensor (bf16 has no numpy dtype: go through float64)
        return t.detach().to("cpu", torch.float64).numpy()
    return np.asarray(t, dtype=np.float64)


def delta_weights(state_dict: Mapping, scaling: float | None = None, where: str = "adapter") -> dict[str, np.ndarray]:
    """{module name (without PEFT's base_model.model. prefix): dW = B @ A (times scaling if given)}."""
    parts: dict[str, dict[str, np.ndarray]] = {}
    names = set()
    for key, value in state_dict.items():
        m = _KEY.match(key)
        if m is None:
            continue
        if m["name"]:
            names.add(m["name"])
        module = m["module"].removeprefix(_PREFIX)
        parts.setdefault(module, {})[m["ab"]] = _as_numpy(value)
    if len(names) > 1:
        raise EvaluationInputError(f"interference: {where} holds several adapters {sorted(names)}; pass one")
    out = {}
    for module, ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise EvaluationInputError(f"interference: {where} module {module} has lora_{''.join(ab)} only")
        a, b = ab["A"], ab["B"]
        if b.ndim != 2 or a.ndim != 2 or b.shape[1] != a.shape[0]:
            raise EvaluationInputError(
                f"interference: {where} module {module}: B {b.shape} @ A {a.shape} does not multiply"
            )
        out[module] = (b @ a) * (1.0 if scaling is None else float(scaling))
    if not out:
        raise EvaluationInputError(f"interference: {where} has no LoRA matrices (keys like *.lora_A.weight)")
    return out


def abs_cosine(u: np.ndarray, v: np.ndarray) -> float | None:
    """|cos| of two flattened updates; None when either is zero (no direction)."""
    nu, nv = float(np.linalg.norm(u)), float(np.linalg.norm(v))
    if nu == 0.0 or nv == 0.0:
        return None
    return min(abs(float(np.dot(u.ravel(), v.ravel()))) / (nu * nv), 1.0)


def _module_result(deltas: dict[str, dict[str, np.ndarray]], module: str) -> dict:
    having = [n for n in deltas if module in deltas[n]]
    best, pair, pairs = None, None, {}
    for a, b in itertools.combinations(having, 2):
        da, db = deltas[a][module], deltas[b][module]
        if da.shape != db.shape:
            raise EvaluationInputError(f"interference: module {module} is {da.shape} in {a} but {db.shape} in {b}")
        c = abs_cosine(da, db)
        pairs[f"{a}|{b}"] = c
        if c is not None and (best is None or c > best):
            best, pair = c, [a, b]
    return {
        "max_abs_cos": best,
        "pair": pair,
        "adapters": having,
        "pairs": pairs,
        "norms": {n: float(np.linalg.norm(deltas[n][module])) for n in having},
    }


def adapter_interference(adapters: Mapping, scalings: Mapping[str, float] | None = None) -> dict:
    """Largest |cos| between any two adapters' dW, per module and over all modules.

    `adapters`: {name: state dict | adapter directory | safetensors file}. JSON-safe:
    {"adapters": [names], "modules": {module: {"max_abs_cos", "pair": [a, b], "adapters": [names
    having it], "pairs": {"a|b": |cos| or None}, "norms": {name: ||dW||_F}}},
    "max_abs_cos": float or None, "pair": [a, b] or None, "module": the module of that pair or None}.
    With fewer than two adapters there is nothing to compare: modules {} and None.
    """
    names = [str(n) for n in adapters]
    out = {"adapters": names, "modules": {}, "max_abs_cos": None, "pair": None, "module": None}
    if len(names) < 2:
        return out
    scalings = scalings or {}
    deltas = {
        str(n): delta_weights(load_adapter(src), scalings.get(str(n)), where=f"adapter {n!r}")
        for n, src in adapters.items()
    }
    modules = sorted({m for d in deltas.values() for m in d})
    for module in modules:
        r = _module_result(deltas, module)
        out["modules"][module] = r
        if r["max_abs_cos"] is not None and (out["max_abs_cos"] is None or r["max_abs_cos"] > out["max_abs_cos"]):
            out.update(max_abs_cos=r["max_abs_cos"], pair=r["pair"], module=module)
    return out
