"""Multi-adapter serving: one frozen base in memory, every serving adapter (LoRA, id rows) on one PeftModel.

Each adapter version is loaded once, under its own PEFT adapter name (a fresh `a<seq>_<hash>` per
load, never reused, so a reload cannot pick up a previous load's state); the readable key
`<model>:<version>` is what the routing table, the metrics and `score(..., return_versions=True)` use.

Mixed batches. Options measured (default ModelConfig, batch 32 over 4 adapters, one thread):

* PEFT's `PeftModel.forward(x, adapter_names=[...])` computes a mixed batch correctly for this model,
  but passes the names by registering forward pre-hooks on the shared layers for the duration of the
  call: with two threads scoring different adapters, 294 of 600 outputs were silently another
  request's (no exception). Moving the names into a ContextVar read by permanent hooks fixes that,
  but PEFT's mixed kernels run four small ops per adapter per layer: 2.4x the merged model's forward.
* grouping rows per adapter behind a lock + `set_adapter`: thread-safe, but serialises all inference
  and runs one forward per adapter in the batch.
* chosen, `serving.batched`: PEFT loads and keeps the adapters on a *store* module tree that shares
  the base's weight tensors and never runs a forward; each routing table serves with a plain tree of
  the base (tensors shared again) whose targeted layers have a forward hook adding each row's LoRA term
  (or, on an id table, its trainable token rows) from weights stacked for that table (a gather and two
  batched matmuls per targeted layer, any number of adapters): 1.16x the merged model's forward on the
  same batch, ~1.1x end to end (`pipelines.bench.serving`). An adapter holding anything the stacks do
  not compute is refused ("unsupported"), never served without it. Each thread passes its rows' stack indices through a ContextVar;
  requests share no mutable state.

Swap and unload safety. A refresh resolves the aliases, loads (download + verify + inject into the
store) what is not loaded yet, builds a new immutable `RoutingTable` with its own stacked weights and
replaces one reference. A request takes a lease on the table it started with and computes every row
with it; nothing it reads is ever modified. An adapter version is deleted from the store once no live
table (the current one, or an old one still leased) names it; the last request to release an old
table does it. So no request fails, waits on a load, or mixes versions during a swap.

The base is `<base_model>@champion` when the server starts. If that alias moves later, the server
keeps its base (adapters trained on the new one are refused as base_mismatch) and `refresh()` reports
`base.stale`; start a new server to change bases.
"""
from __future__ import annotations

import copy
import hashlib
import itertools
import logging
import tempfile
import threading
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch
from prometheus_client import CollectorRegistry

from pipelines.errors import SchemaError
from pipelines.model.family import columns, encode
from pipelines.serving import batched, loader, routing
from pipelines.serving.loader import CANARY, CHAMPION, RefusedVersion, VersionRef
from pipelines.serving.metrics import ServingMetrics
from pipelines.serving.routing import RoutingTable
from pipelines.model.inference import configure_threads

if TYPE_CHECKING:
    from pipelines.config import PipelineConfig

log = logging.getLogger(__name__)

# Deleting the adapter PEFT last made "active" makes it warn about choosing another; the store never
# runs a forward, so which adapter PEFT calls active does not matter and the warning is noise.
warnings.filterwarnings("ignore", message=r"Adapter \S+ was active which is now deleted")

_CHUNK = 4096
_RETRYABLE = frozenset({"download"})


class AdapterServer:
    """Scores contract rows with `ctr_lora_<slot>@champion` (or @canary, or the cold-start adapter).

    Rows of a slot with no adapter get the base's output. `new_users` marks new users: a boolean
    column name (absent column = nobody is new) or a callable `frame -> bool array`. `canary_share`
    in [0, 1] is the share of users (stable hash of user_id) sent to a model's @canary when it has one.
    """

    def __init__(self, slots: Sequence[str], *, adapter_prefix: str = "ctr_lora_",
                 cold_start_model: str | None = "ctr_lora_cold_start", base_model: str = "ctr_base",
                 canary_share: float = 0.0, new_users: routing.NewUsers | None = "is_new_user",
                 tracking_uri: str | None = None, registry_uri: str | None = None, refresh_now: bool = True):
        if not 0.0 <= canary_share <= 1.0:
            raise ValueError(f"canary_share must be in [0, 1], got {canary_share}")
        configure_threads()
        self.slots, self.adapter_prefix, self.cold_start_model = tuple(slots), adapter_prefix, cold_start_model
        self.canary_share, self.new_users = float(canary_share), new_users
        self.registry = loader.Registry(tracking_uri, registry_uri)
        with tempfile.TemporaryDirectory() as tmp:
            self.base_ref, self._base, self.base_fingerprint = loader.load_base(self.registry, base_model, tmp)
        self._cfg = self._base.cfg
        self._columns = columns(self._cfg)[0]   # what a request must carry (the base family's input)
        self._hooked = batched.hookable(self._base)
        # PEFT injects into this tree in place; the memo makes it share the serving tree's tensors.
        self._store_base = copy.deepcopy(self._base, {id(t): t for t in (*self._base.parameters(),
                                                                          *self._base.buffers())})
        self._peft = None                        # the store PeftModel, created by the first adapter load
        self._lock = threading.Lock()            # guards the table, leases and the loaded map
        self._store_lock = threading.Lock()      # guards the store (load, delete, stacking)
        self._refresh_lock = threading.Lock()    # one refresh at a time
        self._seq = itertools.count(1)
        self._table = RoutingTable(0, self.base_ref.key, {}, model=self._base)
        self._live: dict[int, RoutingTable] = {0: self._table}   # current + old tables still leased
        self._leases: dict[int, int] = {}
        self._loaded: dict[str, str] = {}        # <model>:<version> -> PEFT adapter name
        self._pinned: set[str] = set()           # loaded by a refresh whose table is not installed yet
        self._refused: dict[str, dict] = {}      # permanent refusals, by key
        self.metrics = ServingMetrics()
        if refresh_now:
            self.refresh()

    @classmethod
    def from_config(cls, cfg: PipelineConfig, **kwargs) -> AdapterServer:
        """A server for a PipelineConfig's slots, registry names and cold-start model."""
        return cls(cfg.data.slots, adapter_prefix=cfg.registry.adapter_model_prefix,
                   cold_start_model=cfg.cold_start.model_name, base_model=cfg.registry.base_model_name, **kwargs)

    # ------------------------------------------------------------------ introspection

    @property
    def metrics_registry(self) -> CollectorRegistry:
        """This server's own Prometheus registry (serve it with prometheus_client's exposition helpers)."""
        return self.metrics.registry

    def metrics_text(self) -> str:
        """The Prometheus text exposition of this server's metrics."""
        return self.metrics.render()

    @property
    def required_columns(self) -> tuple[str, ...]:
        """The contract columns a request row must carry (what the serving base's family reads)."""
        return tuple(self._columns)

    def routes(self) -> dict[str, str]:
        """{"<model>@<alias>": "<model>:<version>"} of the current table."""
        return self._table.describe()

    def loaded_versions(self) -> list[str]:
        """Every adapter version in memory (serving or draining)."""
        with self._lock:
            return sorted(self._loaded)

    def watched(self) -> list[tuple[str, str]]:
        """The (model, alias) routes a refresh resolves."""
        models = [self.adapter_prefix + s for s in self.slots]
        if self.cold_start_model:
            models.append(self.cold_start_model)
        aliases = (CHAMPION, CANARY) if self.canary_share > 0 else (CHAMPION,)
        return [(m, a) for m in models for a in aliases]

    # ------------------------------------------------------------------ scoring

    def score(self, frame: pd.DataFrame, return_versions: bool = False
              ) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """pCTR per row, in row order (float32 array); with return_versions, also the object array of
        the `<model>:<version>` that scored each row (the base's own key for rows without an adapter).
        Raises SchemaError when a feature column is missing."""
        missing = [c for c in self._columns if c not in frame.columns]
        if missing:
            raise SchemaError(f"request is missing feature columns {missing}")
        tokens = encode(frame, self._cfg)
        canary = routing.canary_mask(frame["user_id"], self.canary_share)
        new = routing.new_user_mask(frame, self.new_users)
        table = self._acquire()
        try:
            keys = routing.assign(table, frame, prefix=self.adapter_prefix, cold_model=self.cold_start_model,
                                  canary=canary, new=new)
            rows = table.stack_rows(keys)
            start = time.perf_counter()
            probs = self._forward(table, tokens, rows)
            elapsed = time.perf_counter() - start
        finally:
            self._release(table)
        for key in pd.unique(keys):
            self.metrics.inference_seconds.labels(adapter=key).observe(elapsed)
        return (probs, keys) if return_versions else probs

    def _forward(self, table: RoutingTable, tokens: np.ndarray, rows: np.ndarray) -> np.ndarray:
        out = []
        for i in range(0, len(tokens), _CHUNK):
            x, r = torch.from_numpy(tokens[i:i + _CHUNK]), torch.from_numpy(rows[i:i + _CHUNK])
            with torch.inference_mode(), batched.request(table.stacks, r):
                out.append(torch.sigmoid(table.model(x)).numpy())
        return np.concatenate(out) if out else np.zeros(0, dtype=np.float32)

    def _acquire(self) -> RoutingTable:
        with self._lock:
            table = self._table
            self._leases[table.generation] = self._leases.get(table.generation, 0) + 1
            return table

    def _release(self, table: RoutingTable) -> None:
        with self._lock:
            left = self._leases[table.generation] - 1
            if left:
                self._leases[table.generation] = left
                return
            del self._leases[table.generation]
            retired = table is not self._table
            if retired:
                self._live.pop(table.generation, None)
        if retired:
            self._collect()

    # ------------------------------------------------------------------ refresh

    def resolve(self) -> dict[tuple[str, str], VersionRef]:
        """Ask the registry what each watched alias names now (absent aliases are left out)."""
        out = {}
        for model, alias in self.watched():
            ref = loader.resolve_alias(self.registry, model, alias)
            if ref is not None:
                out[(model, alias)] = ref
        return out

    def refresh(self) -> dict:
        """Resolve the aliases and `apply` them; see `apply` for the returned dict, plus
        "base": {"serving", "champion", "stale"}. Raises RegistryError, changing nothing, when the
        registry cannot be read."""
        report = self.apply(self.resolve())
        champion = loader.resolve_alias(self.registry, self.base_ref.model, CHAMPION)
        report["base"] = {"serving": self.base_ref.key, "champion": champion.key if champion else None,
                          "stale": champion is None or champion.key != self.base_ref.key}
        if report["base"]["stale"]:
            log.warning("serving base %s is no longer %s@champion (now %s); restart the server to change bases",
                        self.base_ref.key, self.base_ref.model, report["base"]["champion"])
        return report

    def apply(self, resolved: dict[tuple[str, str], VersionRef]) -> dict:
        """Serve `resolved` ((model, alias) -> version): load what is missing, swap, unload the unused.

        A refused version never serves; its route keeps the version it had (or none). Returns
        {"swapped": bool, "routes": {"m@alias": "m:v"}, "loaded": [keys], "unloaded": [keys],
        "draining": [keys still used by in-flight requests], "refused": [{model, version, alias,
        reason, error}]}.
        """
        with self._refresh_lock:
            current = self._table
            try:
                routes, loaded, refused = self._load_routes(current, resolved)
                swapped = routes != dict(current.routes)
                if swapped:
                    self._install(routes)
            finally:
                with self._lock:
                    self._pinned.clear()
            unloaded = self._collect()
            with self._lock:
                draining = sorted(set(self._loaded) - self._table.keys())
        return {"swapped": swapped, "routes": self._table.describe(), "loaded": loaded, "unloaded": unloaded,
                "draining": draining, "refused": refused}

    def _load_routes(self, current: RoutingTable, resolved: dict[tuple[str, str], VersionRef]):
        """(routes, loaded keys, refusals): each route's version loaded, or the current one when refused."""
        routes, loaded, refused = {}, [], []
        for (model, alias), ref in sorted(resolved.items()):
            try:
                if self._ensure_loaded(ref):
                    loaded.append(ref.key)
                routes[(model, alias)] = ref.key
            except RefusedVersion as exc:
                refused.append({"model": model, "version": ref.version, "alias": alias,
                                "reason": exc.reason, "error": exc.detail})
                if current.lookup(model, alias) is not None:
                    routes[(model, alias)] = current.lookup(model, alias)
        return routes, loaded, refused

    def _ensure_loaded(self, ref: VersionRef) -> bool:
        """True when this call loaded `ref`; raises RefusedVersion (counted once per version)."""
        with self._lock:
            if ref.key in self._loaded:
                self._pinned.add(ref.key)  # may be draining: keep it from being collected before the swap
                return False
        if ref.key in self._refused:
            r = self._refused[ref.key]
            raise RefusedVersion(ref, r["reason"], r["error"])
        try:
            self._load(ref)
        except RefusedVersion as exc:
            log.error("%s", exc)
            self.metrics.refused_loads.labels(reason=exc.reason).inc()
            if exc.reason not in _RETRYABLE:
                self._refused[ref.key] = {"reason": exc.reason, "error": exc.detail}
            raise
        return True

    def _load(self, ref: VersionRef) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            adapter_dir = loader.fetch_adapter(self.registry, ref, self.base_fingerprint, tmp, self._cfg.family)
            name = f"a{next(self._seq)}_{hashlib.sha256(ref.key.encode()).hexdigest()[:10]}"
            with self._store_lock:
                self._inject(ref, adapter_dir, name)
        with self._lock:
            self._loaded[ref.key] = name
            self._pinned.add(ref.key)
            self.metrics.loaded_adapters.set(len(self._loaded))
        self.metrics.adapter_loads.inc()
        log.info("loaded %s as PEFT adapter %s", ref.key, name)

    def _inject(self, ref: VersionRef, adapter_dir: Path, name: str) -> None:
        """Add the adapter to the store PeftModel (caller holds the store lock)."""
        try:
            # batched.load_adapter, not PEFT's: once a token adapter is in the store, PEFT 0.21.2 cannot load
            # an adapter without tokens on the same tables (see there)
            self._peft = batched.load_adapter(self._peft, self._store_base, str(adapter_dir), name)
            problems = batched.unsupported(self._store_base, name, self._hooked)
        except Exception as exc:
            self._drop(name)
            raise RefusedVersion(ref, "invalid", f"PEFT cannot load the adapter: {type(exc).__name__}: {exc}") from exc
        if problems:
            self._drop(name)
            raise RefusedVersion(ref, "unsupported", "; ".join(problems))

    def _drop(self, name: str) -> None:
        if self._peft is not None and name in self._peft.peft_config:
            self._peft.delete_adapter(name)

    def _install(self, routes: dict[tuple[str, str], str]) -> None:
        with self._lock:
            old = self._table
        adapters = tuple(sorted(set(routes.values())))
        stacks, model = old.stacks, old.model   # same versions, other routes (canary <-> champion): reuse
        if adapters != old.adapters:
            with self._store_lock:
                stacks = batched.build_stacks(self._store_base, [self._loaded[k] for k in adapters])
            if set(stacks) != set(old.stacks):
                model = batched.serving_tree(self._base, frozenset(stacks))
        with self._lock:
            table = RoutingTable(old.generation + 1, self.base_ref.key, dict(routes), adapters, stacks, model)
            self._table = table
            self._live[table.generation] = table
            if not self._leases.get(old.generation):
                self._live.pop(old.generation, None)
            self.metrics.active_adapters.set(len(table.keys()))
        self.metrics.swaps.inc()
        log.info("routing table %d: %s", table.generation, table.describe())

    def _collect(self) -> list[str]:
        """Delete the adapter versions no live table names; returns their keys."""
        with self._lock:
            live = set(self._pinned).union(*(t.keys() for t in self._live.values()))
            doomed = {k: self._loaded.pop(k) for k in sorted(self._loaded) if k not in live}
            self.metrics.loaded_adapters.set(len(self._loaded))
        if not doomed:
            return []
        with self._store_lock:
            for name in doomed.values():
                self._peft.delete_adapter(name)
        self.metrics.adapter_unloads.inc(len(doomed))
        log.info("unloaded %s", sorted(doomed))
        return sorted(doomed)
