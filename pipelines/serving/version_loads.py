"""`AdapterServer`'s loads: which version each route serves after a refresh (loaded now, kept, held for
a base switch, or late past the load budget), and loading one version into a base's store (download,
verify, inject) with its refusals remembered per version and base (see `serving.router`'s docstring). A
mixin, like `serving.base_changes`, because it works on the server's stores, pins and metrics under the
server's lock; kept apart so each file reads as one idea.
"""

from __future__ import annotations

import logging
import tempfile
import time

from pipelines.serving.base_store import BaseStore
from pipelines.serving.loader import RETRYABLE, RefusedVersion, Route, VersionRef
from pipelines.serving.routing import RoutingTable

log = logging.getLogger("pipelines.serving.router")


class VersionLoads:
    def _load_routes(
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
                if self._ensure_loaded(ref, store):
                    loaded.append(ref.key)
                routes[(model, alias)] = ref.key
            except RefusedVersion as exc:
                refused.append(
                    {"model": model, "version": ref.version, "alias": alias, "reason": exc.reason, "error": exc.detail}
                )
                if keep is not None:
                    routes[(model, alias)] = keep
        return routes, loaded, refused, late

    def _in_memory(self, ref: VersionRef, store: BaseStore) -> bool:
        with self._lock:
            return ref.key in store.loaded

    def _ensure_loaded(self, ref: VersionRef, store: BaseStore) -> bool:
        """True when this call loaded `ref` into `store`; raises RefusedVersion (counted once per version
        and base)."""
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
