"""What the registry records about a model's bytes, and the checks against that record.

At logging time `file_hashes(adapter_dir)` is recorded in the model's `meta.json` (travels with the
artifact: detects corruption only) and, with the base the adapter was trained on, as the *integrity
record* (`record`): tags on the logged model (the hashes also on its run), copied onto the version
at registration (`mlflow_io.register`).
Tags live in the tracking/registry database, out of reach of whoever can write the artifact store;
the serving router and the trusted loader (`registry.pyfunc.load`) check the bytes they load
against them. `verify_files` refuses a directory whose files differ in any way: changed bytes, a
missing file or an extra one.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pipelines.errors import RegistryError

TAG = "adapter.sha256"
# A base version's record: the sha256 over its weights (pipelines.model.base.fingerprint).
FINGERPRINT_TAG = "fingerprint"
# An adapter version's record besides TAG: the base it was trained on (its registered name and
# version, and that base's fingerprint, which the loaded base must match).
BASE_TAGS = ("base.name", "base.version", "base.fingerprint")
# A base version's model family (pipelines.model.family): what its files are built as. A family that is
# not built in is code, loaded only because this record names it. Absent (bases logged before families
# existed): the default family.
FAMILY_TAG = "model.family"
DEFAULT_FAMILY = "feature_transformer"  # == pipelines.model.family.DEFAULT (a test keeps them equal)
RECORD_KEYS = (TAG, FINGERPRINT_TAG, *BASE_TAGS, FAMILY_TAG)
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
    return {
        p.relative_to(d).as_posix(): sha256_file(p)
        for p in sorted(d.rglob("*"))
        if p.is_file() and p.name not in IGNORED
    }


def combined(hashes: dict[str, str]) -> str:
    """One sha256 over a {file: sha256} map: a short, order-independent identity of the adapter's bytes."""
    return hashlib.sha256(json.dumps(hashes, sort_keys=True).encode()).hexdigest()


def verify_files(directory: str | Path, expected: dict[str, str] | str | None, what: str) -> dict[str, str]:
    """Raise RegistryError unless the files under `directory` hash exactly to `expected`.

    `expected` is a {file: sha256} map or its JSON (as stored in the version tag). `what` names the
    model version in the error. Returns the actual hashes.
    """
    if expected is None or expected == "":
        raise RegistryError(
            f"{what}: no recorded adapter file hashes ({TAG}); refusing to load an unverifiable adapter"
        )
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
        raise RegistryError(
            f"{what}: adapter files do not match the registry ({'; '.join(problems)}); refusing to load"
        )
    return actual


def record(meta: dict) -> dict[str, str]:
    """The integrity record of a model being logged, from its meta.json contents (`adapter_files` of an
    adapter, `fingerprint` of a base): the tags its logged model, and later its version, carry."""
    if meta["kind"] == "base":
        return {
            FINGERPRINT_TAG: meta["fingerprint"],
            FAMILY_TAG: str((meta.get("model") or {}).get("family") or DEFAULT_FAMILY),
        }
    b = meta["base"]
    out = {
        TAG: json.dumps(meta["adapter_files"], sort_keys=True),
        "base.name": str(b["name"]),
        "base.version": str(b["version"]),
        "base.fingerprint": str(b["fingerprint"]),
    }
    if b.get("family"):  # an adapter's family is its base's (absent where its base reference predates families)
        out[FAMILY_TAG] = str(b["family"])
    return out


def of_tags(tags: dict | None) -> dict[str, str]:
    """The integrity record within a set of tags (a version's, a logged model's); empty values dropped."""
    return {k: str(tags[k]) for k in RECORD_KEYS if (tags or {}).get(k)}


def family_of(rec: dict | None) -> str:
    """The model family a base's record (or tags) names; the default for bases recorded before families."""
    return str((rec or {}).get(FAMILY_TAG) or DEFAULT_FAMILY)


def required(rec: dict, key: str, what: str) -> str:
    """rec[key], or RegistryError: a model whose record lacks it cannot be verified, so it does not load."""
    value = rec.get(key)
    if not value:
        raise RegistryError(f"{what}: the registry records no {key!r} for it; refusing to load an unverifiable model")
    return str(value)


def check_fingerprint(actual: str, expected: str, what: str) -> None:
    if actual != expected:
        raise RegistryError(
            f"{what}: weights hash to fingerprint {actual[:12]}..., the registry recorded "
            f"{expected[:12]}...; refusing to load"
        )
