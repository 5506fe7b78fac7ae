"""`AdapterServer`'s eviction: which adapter versions leave memory (the policy is `serving.router`'s
docstring, "Idle versions").

Every version of a base that left memory goes (an old base no live table serves, a pending base dropped
or replaced); on the serving base, the versions no live table routes and no refresh has pinned are idle,
and those past `max_loaded` go, least recently routed first. A pending base's versions wait for its switch.

An object the server holds. It owns the recency of each version (the tick of the last table that routed
it) and the stores it saw last (one that is gone is emptied). It takes no lock of its own: `routed` and
`select` run under the server's lock, in the same critical section as the table swap or the read of the
live tables they act on; `evict` (PEFT deletes) runs outside it.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Sequence

from pipelines.serving.base_store import BaseStore
from pipelines.serving.metrics import ServingMetrics
from pipelines.serving.routing import RoutingTable

log = logging.getLogger("pipelines.serving.router")


def in_memory(current: RoutingTable, live_tables: Iterable[RoutingTable], pending: BaseStore | None) -> list[BaseStore]:
    """Every base in memory: the serving one, those old tables still being read hold, a pending one."""
    stores = {id(t.base): t.base for t in live_tables}
    stores[id(current.base)] = current.base
    if pending is not None:
        stores[id(pending)] = pending
    return list(stores.values())


class Eviction:
    def __init__(self, max_loaded: int, metrics: ServingMetrics, stores: Sequence[BaseStore]):
        self.max_loaded, self.metrics = max_loaded, metrics
        self._tick = itertools.count(1)
        self._last_routed: dict[str, int] = {}  # version key -> tick of the last table that routed it (LRU)
        self._known_stores: list[BaseStore] = list(stores)  # the stores `select` saw last: one that leaves is emptied

    def routed(self, keys: Iterable[str]) -> None:
        """These versions were routed until now (a table swap); caller holds the server's lock."""
        tick = next(self._tick)
        for key in keys:
            self._last_routed[key] = tick

    def select(
        self,
        current: RoutingTable,
        live_tables: Sequence[RoutingTable],
        pinned: frozenset[str],
        pending: BaseStore | None,
    ) -> dict[BaseStore, list[tuple[str, str]]]:
        """Take what must go out of each store's `loaded` map: {store: [(version key, PEFT name)]}, for
        `evict`. `live_tables`: the current table and old ones still leased; caller holds the server's lock."""
        serving, stores = current.base, in_memory(current, live_tables, pending)
        doomed: dict[BaseStore, list[str]] = {
            s: list(s.loaded) for s in self._known_stores if s not in stores and s.loaded
        }
        self._known_stores = list(stores)
        for store in stores:
            if store is pending:
                continue
            live = set(pinned).union(*(t.keys() for t in live_tables if t.base is store))
            idle = [k for k in store.loaded if k not in live]
            if store is serving:
                room = max(0, self.max_loaded - (len(store.loaded) - len(idle)))
                idle.sort(key=lambda k: self._last_routed.get(k, 0), reverse=True)
                idle = idle[room:]
                held = len(store.loaded) - len(idle)
                self.metrics.cap_exceeded.set(int(held > self.max_loaded))
            if idle:
                doomed[store] = idle
        taken = {store: [(k, store.loaded.pop(k)) for k in keys] for store, keys in doomed.items()}
        still_held = {k for s in stores for k in s.loaded}
        self._last_routed = {k: t for k, t in self._last_routed.items() if k in still_held}
        self.metrics.loaded_adapters.set(sum(len(s.loaded) for s in stores))
        return taken

    def evict(self, taken: dict[BaseStore, list[tuple[str, str]]]) -> list[str]:
        """Delete what `select` took from each store's PEFT tree; returns the evicted version keys."""
        for store, versions in taken.items():
            store.delete([name for _, name in versions])
        evicted = sorted(k for versions in taken.values() for k, _ in versions)
        if evicted:
            self.metrics.adapter_unloads.inc(len(evicted))
            log.info("unloaded %s", evicted)
        return evicted
