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
  not compute is refused ("unsupported"), never served without it. Each thread passes its rows' stack indices through
  a ContextVar;
  requests share no mutable state.

Swap and unload safety. A refresh resolves the aliases, loads (download + verify + inject into the
store) what is not loaded yet, builds a new immutable `RoutingTable` with its own stacked weights and
replaces one reference. A request takes a lease on the table it started with and computes every row
with it; nothing it reads is ever modified. An adapter version becomes idle once no live table (the
current one, or an old one still leased) names it, and is only then eligible for eviction (below); the
last request to release an old table triggers that. So no request fails, waits on a load, or mixes versions during a
swap.

Base changes without a restart. The base is `<base_model>@champion` when the server starts. When that
alias moves, the new base is loaded beside the old one (its own `BaseStore`), the adapter versions
trained on it are loaded into it as their aliases name them, and the whole table (base + every slot)
switches in one swap once every watched champion names a version on the new base
(`serving.base_switch`). Until then the old base serves with its adapters, an alias already on the new
base keeps its old version, and `refresh()` reports the pending base and what it waits for.

Load budget. Requests never wait on a load, but the moves of one refresh go live together: once a
refresh's loads (download, verify, inject) have taken `load_budget_ms`, what is loaded is installed at
once, the aliases still to load keep their previous versions (counted in `lora_slow_loads_total`), and
they switch in a second swap when loaded. A base switch is exempt: it is all slots or none.

Idle versions. A version no table routes to any more stays in memory (a revert to it is then a swap,
not a download) while the total held stays within `max_loaded_adapters`: idle versions beyond the cap
are evicted least recently routed first. Routed and draining versions are never evicted; when they
alone pass the cap, the cap is reported exceeded (metric and log), not enforced against live traffic.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch
from prometheus_client import CollectorRegistry

from pipelines.errors import RegistryError, SchemaError
from pipelines.model.family import encode
from pipelines.model.inference import configure_threads
from pipelines.serving import batched, eviction, loader, routing
from pipelines.serving.base_changes import BaseChanges
from pipelines.serving.base_store import BaseStore
from pipelines.serving.loader import CANARY, CHAMPION, Route, VersionRef
from pipelines.serving.metrics import ServingMetrics
from pipelines.serving.routing import RoutingTable
from pipelines.serving.version_loads import VersionLoads

if TYPE_CHECKING:
    from pipelines.config import PipelineConfig

log = logging.getLogger(__name__)

# Deleting the adapter PEFT last made "active" makes it warn about choosing another; the store never
# runs a forward, so which adapter PEFT calls active does not matter and the warning is noise.
warnings.filterwarnings("ignore", message=r"Adapter \S+ was active which is now deleted")

_CHUNK = 4096
DEFAULT_MAX_LOADED = 16
DEFAULT_LOAD_BUDGET_MS = 100.0


class AdapterServer:
    """Scores contract rows with `ctr_lora_<slot>@champion` (or @canary, or the cold-start adapter).

    Rows of a slot with no adapter get the base's output. `new_users` marks new users: a boolean
    column name (absent column = nobody is new) or a callable `frame -> bool array`. `canary_share`
    in [0, 1] is the share of users (stable hash of user_id) sent to a model's @canary when it has one.
    `max_loaded_adapters` caps the adapter versions held in memory; `load_budget_ms` bounds how long
    a refresh's loads may hold back the moves already loaded (None: no bound); see the module docstring.

    It owns the routing tables and their leases, and holds `VersionLoads`, `BaseChanges` and `Eviction`,
    each given the server's one lock so that a table swap, a load and an eviction see each other whole.
    """

    def __init__(
        self,
        slots: Sequence[str],
        *,
        adapter_prefix: str = "ctr_lora_",
        cold_start_model: str | None = "ctr_lora_cold_start",
        base_model: str = "ctr_base",
        canary_share: float = 0.0,
        new_users: routing.NewUsers | None = "is_new_user",
        tracking_uri: str | None = None,
        registry_uri: str | None = None,
        refresh_now: bool = True,
        max_loaded_adapters: int = DEFAULT_MAX_LOADED,
        load_budget_ms: float | None = DEFAULT_LOAD_BUDGET_MS,
    ):
        if not 0.0 <= canary_share <= 1.0:
            raise ValueError(f"canary_share must be in [0, 1], got {canary_share}")
        if max_loaded_adapters < 0:
            raise ValueError(f"max_loaded_adapters must be >= 0, got {max_loaded_adapters}")
        configure_threads()
        self.slots, self.adapter_prefix, self.cold_start_model = tuple(slots), adapter_prefix, cold_start_model
        self.base_model, self.max_loaded_adapters = base_model, int(max_loaded_adapters)
        self.load_budget_ms = load_budget_ms
        self.canary_share, self.new_users = float(canary_share), new_users
        self.registry = loader.Registry(tracking_uri, registry_uri)
        self.metrics = ServingMetrics()
        ref = loader.resolve_alias(self.registry, base_model, CHAMPION)
        if ref is None:
            raise RegistryError(f"no serving base: {base_model}@{CHAMPION} is not set")
        base = BaseStore.load(self.registry, ref)
        self._lock = threading.Lock()  # guards the tables, leases, pins, pending base and every store's loaded map
        self._refresh_lock = threading.Lock()  # one refresh at a time
        self._table = RoutingTable(0, base.key, {}, model=base.model, base=base)
        self._live: dict[int, RoutingTable] = {0: self._table}  # current + old tables still leased
        self._leases: dict[int, int] = {}
        self._last_read: tuple[dict, VersionRef | None] | None = None  # the last refresh's registry answer
        self._loads = VersionLoads(self.registry, self.metrics, self._lock)
        self._bases = BaseChanges(self.registry, self.metrics, self._lock, self._loads)
        self._eviction = eviction.Eviction(self.max_loaded_adapters, self.metrics, [base])
        self.metrics.base_info.labels(version=base.key, state="serving").set(1)
        if refresh_now:
            self.refresh()

    @classmethod
    def from_config(cls, cfg: PipelineConfig, **kwargs) -> AdapterServer:
        """A server for a PipelineConfig's slots, registry names and cold-start model."""
        return cls(
            cfg.data.slots,
            adapter_prefix=cfg.registry.adapter_model_prefix,
            cold_start_model=cfg.cold_start.model_name,
            base_model=cfg.registry.base_model_name,
            **kwargs,
        )

    # ------------------------------------------------------------------ introspection

    @property
    def metrics_registry(self) -> CollectorRegistry:
        """This server's own Prometheus registry (serve it with prometheus_client's exposition helpers)."""
        return self.metrics.registry

    def metrics_text(self) -> str:
        """The Prometheus text exposition of this server's metrics."""
        return self.metrics.render()

    @property
    def base_ref(self) -> VersionRef:
        """The base version serving now."""
        return self._table.base.ref

    @property
    def required_columns(self) -> tuple[str, ...]:
        """The contract columns a request row must carry (what the serving base's family reads)."""
        return self._table.base.columns

    def routes(self) -> dict[str, str]:
        """{"<model>@<alias>": "<model>:<version>"} of the current table."""
        return self._table.describe()

    def loaded_versions(self) -> list[str]:
        """Every adapter version in memory (serving, draining, idle, or loaded on a pending base)."""
        with self._lock:
            stores = eviction.in_memory(self._table, self._live.values(), self._bases.pending)
            return sorted({k for store in stores for k in store.loaded})

    def watched(self) -> list[tuple[str, str]]:
        """The (model, alias) routes a refresh resolves."""
        models = [self.adapter_prefix + s for s in self.slots]
        if self.cold_start_model:
            models.append(self.cold_start_model)
        aliases = (CHAMPION, CANARY) if self.canary_share > 0 else (CHAMPION,)
        return [(m, a) for m in models for a in aliases]

    # ------------------------------------------------------------------ scoring

    def score(self, frame: pd.DataFrame, return_versions: bool = False) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """pCTR per row, in row order (float32 array); with return_versions, also the object array of
        the `<model>:<version>` that scored each row (the base's own key for rows without an adapter).
        Raises SchemaError when a feature column is missing."""
        table = self._acquire()
        try:
            missing = [c for c in table.base.columns if c not in frame.columns]
            if missing:
                raise SchemaError(f"request is missing feature columns {missing}")
            tokens = encode(frame, table.base.cfg)
            canary = routing.canary_mask(frame["user_id"], self.canary_share)
            new = routing.new_user_mask(frame, self.new_users)
            keys = routing.assign(
                table, frame, prefix=self.adapter_prefix, cold_model=self.cold_start_model, canary=canary, new=new
            )
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
            x, r = torch.from_numpy(tokens[i : i + _CHUNK]), torch.from_numpy(rows[i : i + _CHUNK])
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

    def resolve(self) -> dict[Route, VersionRef]:
        """Ask the registry what each watched alias names now (absent aliases are left out)."""
        out = {}
        for model, alias in self.watched():
            ref = loader.resolve_alias(self.registry, model, alias)
            if ref is not None:
                out[(model, alias)] = ref
        return out

    def refresh(self, only: Iterable[Route] | None = None) -> dict:
        """Resolve the aliases and the base's champion and serve them; see `apply` for the returned
        dict, plus "base": {"serving", "champion", "stale" (serving is not the champion), "pending"
        (None, or {"version", "waiting_for": [...], "dropped": [...]}: a new base not switched to yet)}.

        `only`: re-read just these (model, alias) routes (a webhook named them) and keep what the last
        refresh read for the others; routes this server does not watch are ignored. Raises
        RegistryError, changing nothing, when the registry cannot be read."""
        with self._refresh_lock:
            resolved, champion = self._read(only)
            serving = self._table.base
            if champion is None or champion.key == serving.key:
                self._bases.drop_pending()
                report, pending = self._apply(resolved, serving), None
            else:
                report, pending = self._toward(champion, resolved)
            self._last_read = (resolved, champion)
        report["base"] = {
            "serving": self.base_ref.key,
            "champion": champion.key if champion else None,
            "stale": champion is None or champion.key != self.base_ref.key,
            "pending": pending,
        }
        if pending is not None:
            log.warning("new base %s waits: %s", champion.key, pending["waiting_for"])
        return report

    def _read(self, only: Iterable[Route] | None) -> tuple[dict[Route, VersionRef], VersionRef | None]:
        """(what each watched alias names, base@champion): all of it, or only the `only` routes re-read
        over the last refresh's answer (a full read when there is none yet)."""
        if only is None or self._last_read is None:
            return self.resolve(), loader.resolve_alias(self.registry, self.base_model, CHAMPION)
        resolved, champion = dict(self._last_read[0]), self._last_read[1]
        watched = set(self.watched())
        for model, alias in set(only):
            if (model, alias) in watched:
                ref = loader.resolve_alias(self.registry, model, alias)
                if ref is None:
                    resolved.pop((model, alias), None)
                else:
                    resolved[(model, alias)] = ref
            elif (model, alias) == (self.base_model, CHAMPION):
                champion = loader.resolve_alias(self.registry, self.base_model, CHAMPION)
        return resolved, champion

    def _toward(self, champion: VersionRef, resolved: dict[Route, VersionRef]) -> tuple[dict, dict | None]:
        """A refresh while base@champion names another base than the serving one: prepare the new base
        and its adapters, switch when `base_switch.plan` says ready, else keep serving the old pair."""
        serving = self._table.base
        new = self._bases.prepare(champion, resolved)
        if new.store is None:  # the new base cannot serve (now, or at all): the old pair carries on, nothing held
            return self._apply(resolved, serving), new.waiting()
        if not new.plan.ready:
            report = self._apply(resolved, serving, held=new.plan.held)
            report["loaded"] += new.loaded
            report["refused"] += new.refused
            return report, new.waiting()
        try:
            self._install({r: ref.key for r, ref in new.plan.on_new.items()}, new.store)
        finally:
            self._loads.unpin()
        self._bases.switched(serving)
        log.info("switched base %s -> %s with %s", serving.key, new.store.key, self.routes())
        return self._report(True, list(new.loaded), list(new.refused)), None

    def apply(self, resolved: dict[Route, VersionRef]) -> dict:
        """Serve `resolved` ((model, alias) -> version) on the serving base: load what is missing, swap,
        evict idle versions past the cap.

        A refused version never serves; its route keeps the version it had (or none). Returns
        {"swapped": bool, "routes": {"m@alias": "m:v"}, "loaded": [keys], "unloaded": [keys],
        "draining": [keys still used by in-flight requests], "refused": [{model, version, alias,
        reason, error}]}.
        """
        with self._refresh_lock:
            return self._apply(resolved, self._table.base)

    def _apply(self, resolved: dict[Route, VersionRef], store: BaseStore, held: frozenset[Route] = frozenset()) -> dict:
        current = self._table
        deadline = None if self.load_budget_ms is None else time.perf_counter() + self.load_budget_ms / 1000
        try:
            routes, loaded, refused, late = self._loads.routes(current, resolved, store, held, deadline)
            swapped = routes != dict(current.routes)
            if swapped:
                self._install(routes, store)
            if late:  # what loaded in time is serving already; the rest switches once loaded
                self.metrics.slow_loads.inc(len(late))
                log.warning(
                    "loads past the %.0f ms budget: %s keep their versions until loaded",
                    self.load_budget_ms,
                    sorted(f"{m}@{a}" for m, a in late),
                )
                more, loaded_late, refused_late, _ = self._loads.routes(self._table, late, store)
                loaded, refused, routes = loaded + loaded_late, refused + refused_late, {**routes, **more}
                if routes != dict(self._table.routes):
                    self._install(routes, store)
                    swapped = True
        finally:
            self._loads.unpin()
        return self._report(swapped, loaded, refused)

    def _report(self, swapped: bool, loaded: list[str], refused: list[dict]) -> dict:
        unloaded = self._collect()
        with self._lock:
            draining = sorted({k for t in self._live.values() for k in t.keys()} - self._table.keys())
        return {
            "swapped": swapped,
            "routes": self._table.describe(),
            "loaded": loaded,
            "unloaded": unloaded,
            "draining": draining,
            "refused": refused,
        }

    def _collect(self) -> list[str]:
        """Evict what `Eviction` says must go, taken under the lock with the tables it was judged on;
        returns the evicted keys."""
        with self._lock:
            live_tables, pinned = list(self._live.values()), self._loads.pinned()
            taken = self._eviction.select(self._table, live_tables, pinned, self._bases.pending)
        return self._eviction.evict(taken)

    def _install(self, routes: dict[Route, str], store: BaseStore) -> None:
        with self._lock:
            old = self._table
        adapters = tuple(sorted(set(routes.values())))
        stacks, model = old.stacks, old.model  # same base and versions, other routes (canary <-> champion): reuse
        if store is not old.base or adapters != old.adapters:
            stacks = store.stacks([store.loaded[k] for k in adapters])
            if store is not old.base or set(stacks) != set(old.stacks):
                model = store.serving_tree(frozenset(stacks))
        with self._lock:
            table = RoutingTable(old.generation + 1, store.key, dict(routes), adapters, stacks, model, base=store)
            self._table = table
            self._live[table.generation] = table
            if not self._leases.get(old.generation):
                self._live.pop(old.generation, None)
            self._eviction.routed(old.keys() | table.keys())  # both were routed until this moment
        self.metrics.active_adapters.set(len(table.keys()))
        self.metrics.swaps.inc()
        log.info("routing table %d on base %s: %s", table.generation, store.key, table.describe())
