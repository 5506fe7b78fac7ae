"""File hashes that tie a registered adapter to the exact bytes it was trained with.

At logging time `file_hashes(adapter_dir)` is recorded twice: in the model's `meta.json` (travels with
the artifact, checked by the pyfunc at load) and as the version tag `adapter.sha256` (lives in the
registry database, out of reach of whoever can write the artifact store; checked by the serving
router). `verify_files` refuses a directory whose files differ in any way: changed bytes, a missing
file or an extra one.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pipelines.errors import RegistryError

TAG = "adapter.sha256"
# PEFT writes a model-card README next to the weights; it does not change what the adapter computes,
# and MLflow may rewrite line endings of text artifacts, so it is not part of the contract.
IGNORED = frozenset({"README.md"})


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def file_hashes(directory: str | Path) -> dict[str, str]:
    """{relative posix path: sha256} of every file under `directory` (sorted, README.md excluded)."""
    d = Path(directory)
    if not d.is_dir():
        raise RegistryError(f"adapter directory {d} does not exist")
    return {p.relative_to(d).as_posix(): sha256_file(p)
            for p in sorted(d.rglob("*")) if p.is_file() and p.name not in IGNORED}


def combined(hashes: dict[str, str]) -> str:
    """One sha256 over a {file: sha256} map: a short, order-independent identity of the adapter's bytes."""
    return hashlib.sha256(json.dumps(hashes, sort_keys=True).encode()).hexdigest()


def verify_files(directory: str | Path, expected: dict[str, str] | str | None, what: str) -> dict[str, str]:
    """Raise RegistryError unless the files under `directory` hash exactly to `expected`.

    `expected` is a {file: sha256} map or its JSON (as stored in the version tag). `what` names the
    model version in the error. Returns the actual hashes.
    """
    if expected is None or expected == "":
        raise RegistryError(f"{what}: no recorded adapter file hashes ({TAG}); refusing to load an unverifiable adapter")
    if isinstance(expected, str):
        try:
            expected = json.loads(expected)
        except json.JSONDecodeError as exc:
            raise RegistryError(f"{what}: recorded {TAG} is not valid JSON") from exc
    actual = file_hashes(directory)
    problems = []
    for name in sorted(set(expected) | set(actual)):
        if name not in actual:
            problems.append(f"{name} is missing")
        elif name not in expected:
            problems.append(f"{name} is not part of the registered adapter")
        elif actual[name] != expected[name]:
            problems.append(f"{name} has sha256 {actual[name][:12]}..., recorded {expected[name][:12]}...")
    if problems:
        raise RegistryError(f"{what}: adapter files do not match the registry ({'; '.join(problems)}); "
                            "refusing to load")
    return actual
