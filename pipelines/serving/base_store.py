"""One base in memory and the adapter versions loaded on it, for `router.AdapterServer`.

A server holds one `BaseStore` per base it serves or is about to serve: normally one; two while a new
`ctr_base@champion` loads and waits for its adapters (`serving.base_switch`). Each store owns its own
PEFT *store* tree (see `serving.batched`), so adapters of two bases never meet, and everything about a
version (loaded, refused) is known per base: a version refused as `base_mismatch` on the old base is
exactly the one the new base will load.

The `loaded` map is guarded by the server's lock (it decides what is live across tables); the PEFT
store by this store's own `lock`.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

from torch import nn

from pipelines.model.family import columns
from pipelines.serving import batched, loader
from pipelines.serving.loader import RefusedVersion, VersionRef


class BaseStore:
    def __init__(self, ref: VersionRef, model: nn.Module, fingerprint: str):
        self.ref, self.model, self.fingerprint = ref, model, fingerprint
        self.cfg = model.cfg
        self.columns = tuple(columns(self.cfg)[0])  # what a request must carry (this base family's input)
        self.hooked = batched.hookable(model)
        # PEFT injects into this tree in place; the memo makes it share the serving tree's tensors.
        self._store = copy.deepcopy(model, {id(t): t for t in (*model.parameters(), *model.buffers())})
        self._peft = None  # the store PeftModel, created by the first adapter load
        self.lock = threading.Lock()
        self._seq = itertools.count(1)
        self.loaded: dict[str, str] = {}  # <model>:<version> -> PEFT adapter name
        self.refused: dict[str, dict] = {}  # permanent refusals on this base, by key

    @classmethod
    def load(cls, registry: loader.Registry, ref: VersionRef) -> BaseStore:
        """The base version `ref`, downloaded and checked against its fingerprint tag."""
        with tempfile.TemporaryDirectory() as tmp:
            model, fp = loader.load_base_version(registry, ref, tmp)
        return cls(ref, model, fp)

    @property
    def key(self) -> str:
        return self.ref.key

    def fetch(self, registry: loader.Registry, ref: VersionRef, dst: str | Path) -> Path:
        """Download and check an adapter version for this base (RefusedVersion when it is not one)."""
        return loader.fetch_adapter(registry, ref, self.fingerprint, dst, self.cfg.family)

    def inject(self, ref: VersionRef, adapter_dir: Path) -> str:
        """Add the adapter to the PEFT store under a fresh name (never reused, so a reload cannot pick
        up a previous load's state); returns the name. RefusedVersion when PEFT cannot load it or it
        holds something the batched stacks do not compute."""
        name = f"a{next(self._seq)}_{hashlib.sha256(ref.key.encode()).hexdigest()[:10]}"
        with self.lock:
            try:
                # batched.load_adapter, not PEFT's: once a token adapter is in the store, PEFT 0.21.2 cannot
                # load an adapter without tokens on the same tables (see there)
                self._peft = batched.load_adapter(self._peft, self._store, str(adapter_dir), name)
                problems = batched.unsupported(self._store, name, self.hooked)
            except Exception as exc:
                self._drop(name)
                raise RefusedVersion(
                    ref, "invalid", f"PEFT cannot load the adapter: {type(exc).__name__}: {exc}"
                ) from exc
            if problems:
                self._drop(name)
                raise RefusedVersion(ref, "unsupported", "; ".join(problems))
        return name

    def delete(self, names: Sequence[str]) -> None:
        with self.lock:
            for name in names:
                self._drop(name)

    def _drop(self, name: str) -> None:
        if self._peft is not None and name in self._peft.peft_config:
            self._peft.delete_adapter(name)

    def stacks(self, names: Sequence[str]) -> dict:
        """The batched LoRA weights of these loaded adapters, in order (stack row i+1 = names[i])."""
        with self.lock:
            return batched.build_stacks(self._store, list(names))

    def serving_tree(self, layers: frozenset[str]) -> nn.Module:
        """A forward-only tree of this base with hooks on `layers` (tensors shared with the base)."""
        return batched.serving_tree(self.model, layers)
