"""`AdapterServer`'s loads: which version each route serves after a refresh (loaded now, kept, held for
a base switch, or late past the load budget), and loading one version into a base's store (download,
verify, inject) with its refusals remembered per version and base (see `serving.router`'s docstring).

An object the server holds. It owns the *pinned* versions: those a refresh loaded or found in memory for
a table it has not installed yet, which eviction must spare until the refresh ends (`unpin`). It shares
the server's lock, passed in, because a store's `loaded` map, the pins and the routing tables must be
read together by eviction (`serving.eviction`).
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time

from pipelines.serving import loader
from pipelines.serving.base_store import BaseStore
from pipelines.serving.loader import RETRYABLE, RefusedVersion, Route, VersionRef
from pipelines.serving.metrics import ServingMetrics
from pipelines.serving.routing import RoutingTable

log = logging.getLogger("pipelines.serving.router")


class VersionLoads:
    def __init__(self, registry: loader.Registry, metrics: ServingMetrics, lock: threading.Lock):
        self.registry, self.metrics = registry, metrics
        self._lock = lock  # the server's: guards every store's `loaded` map and the pins
        self._pinned: set[str] = set()  # loaded by a refresh whose table is not installed yet

    def pinned(self) -> frozenset[str]:
        """The version keys eviction must spare until the refresh that pinned them ends (caller holds the lock)."""
        return frozenset(self._pinned)

    def unpin(self) -> None:
        """A refresh ended: its table is installed (or never will be), so what it loaded may be evicted."""
        with self._lock:
            self._pinned.clear()

    def routes(
        self,
        current: RoutingTable,
        resolved: dict[Route, VersionRef],
        store: BaseStore,
        held: frozenset[Route] = frozenset(),
        deadline: float | None = None,
    ):
        """(routes, loaded keys, refusals, late): each route's version loaded, or the current one when
        refused, held (its alias names a version of a base not serving yet) or late (a move to a version
        not in memory when `deadline` had passed: returned in `late` to load next; a route with no
        current version has nothing to keep serving, so it waits for its load)."""
        routes, loaded, refused, late = {}, [], [], {}
        for (model, alias), ref in sorted(resolved.items()):
            keep = current.lookup(model, alias) if current.base is store else None
            late_now = (
                deadline is not None
                and keep is not None
                and keep != ref.key
                and time.perf_counter() > deadline
                and not self._in_memory(ref, store)
            )
            if (model, alias) in held or late_now:
                if (model, alias) not in held:
                    late[(model, alias)] = ref
                if keep is not None:
                    routes[(model, alias)] = keep
                continue
            try:
                if self.ensure_loaded(ref, store):
                    loaded.append(ref.key)
                routes[(model, alias)] = ref.key
            except RefusedVersion as exc:
                refused.append(refusal(model, alias, ref, exc))
                if keep is not None:
                    routes[(model, alias)] = keep
        return routes, loaded, refused, late

    def _in_memory(self, ref: VersionRef, store: BaseStore) -> bool:
        with self._lock:
            return ref.key in store.loaded

    def ensure_loaded(self, ref: VersionRef, store: BaseStore) -> bool:
        """True when this call loaded `ref` into `store`; either way `ref` is pinned. Raises RefusedVersion
        (counted once per version and base)."""
        with self._lock:
            if ref.key in store.loaded:
                self._pinned.add(ref.key)  # may be idle or draining: keep it from being collected before the swap
                return False
        if ref.key in store.refused:
            r = store.refused[ref.key]
            raise RefusedVersion(ref, r["reason"], r["error"])
        try:
            with tempfile.TemporaryDirectory() as tmp:
                name = store.inject(ref, store.fetch(self.registry, ref, tmp))
        except RefusedVersion as exc:
            log.error("%s", exc)
            self.metrics.refused_loads.labels(reason=exc.reason).inc()
            if exc.reason not in RETRYABLE:
                store.refused[ref.key] = {"reason": exc.reason, "error": exc.detail}
            raise
        with self._lock:
            store.loaded[ref.key] = name
            self._pinned.add(ref.key)
        self.metrics.adapter_loads.inc()
        log.info("loaded %s on base %s as PEFT adapter %s", ref.key, store.key, name)
        return True


def refusal(model: str, alias: str, ref: VersionRef, exc: RefusedVersion) -> dict:
    """One entry of a refresh report's "refused" list."""
    return {"model": model, "version": ref.version, "alias": alias, "reason": exc.reason, "error": exc.detail}
