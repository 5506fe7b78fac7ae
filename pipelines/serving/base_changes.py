"""`AdapterServer`'s bases in memory: a base change (a new `<base_model>@champion` is loaded beside the
serving base, its adapters as their aliases name them, and every slot switches in one table swap once
`serving.base_switch.plan` says ready) and eviction across the stores (see `serving.router`'s
docstring). A mixin, because it works on the server's tables, leases and stores under the server's
locks; kept apart so each file reads as one idea.
"""

from __future__ import annotations

import logging

from pipelines.errors import RegistryError
from pipelines.serving import base_switch
from pipelines.serving.base_store import BaseStore
from pipelines.serving.loader import RETRYABLE, RefusedVersion, Route, VersionRef

log = logging.getLogger("pipelines.serving.router")


class BaseChanges:
    def _toward(self, champion: VersionRef, resolved: dict[Route, VersionRef]) -> tuple[dict, dict]:
        """A refresh while base@champion names another base than the serving one: prepare the new base
        and its adapters, switch when `base_switch.plan` says ready, else keep serving the old pair."""
        serving = self._table.base
        pending, why = self._pending_store(champion)
        if pending is None:  # the new base cannot serve (now, or at all): the old pair carries on, nothing held
            return self._apply(resolved, serving), {
                "version": champion.key,
                "dropped": [],
                "waiting_for": [f"{champion.key}: {why}"],
            }
        plan = base_switch.plan(resolved, pending.fingerprint)
        loaded, refused = self._preload(pending, plan)
        # this round's refusals too: a download that failed (retried next time) has not loaded either
        unloadable = {
            **{f"{r['model']}:{r['version']}": r["reason"] for r in refused},
            **{k: r["reason"] for k, r in pending.refused.items()},
        }
        plan = base_switch.plan(resolved, pending.fingerprint, unloadable)
        if plan.ready:
            try:
                self._install({r: ref.key for r, ref in plan.on_new.items()}, pending)
            finally:
                with self._lock:
                    self._pinned.clear()
            self._set_pending(None)
            self.metrics.base_info.remove(serving.key, "serving")
            self.metrics.base_info.labels(version=pending.key, state="serving").set(1)
            self.metrics.base_switches.inc()
            log.info("switched base %s -> %s with %s", serving.key, pending.key, self.routes())
            return self._report(True, loaded, refused), None
        report = self._apply(resolved, serving, held=plan.held)
        report["loaded"] += loaded
        report["refused"] += refused
        return report, {"version": champion.key, "waiting_for": list(plan.waiting), "dropped": list(plan.dropped)}

    def _pending_store(self, champion: VersionRef) -> tuple[BaseStore | None, str | None]:
        """(the store of base version `champion`, loaded once; None) or (None, why it cannot serve): refused
        for good (remembered), or its download failed (tried again next refresh)."""
        if self._pending is not None and self._pending.key == champion.key:
            return self._pending, None
        self._set_pending(None)  # another new base (or none loadable) replaces a pending one
        if champion.key in self._refused_bases:
            return None, self._refused_bases[champion.key]
        try:
            store = BaseStore.load(self.registry, champion)
        except RegistryError as exc:
            if isinstance(exc.__cause__, RefusedVersion) and exc.__cause__.reason in RETRYABLE:
                log.warning("new base %s could not be downloaded (next refresh retries): %s", champion.key, exc)
                return None, f"download failed, retrying: {exc}"
            return None, self._refuse_base(champion, exc)
        except Exception as exc:  # a base that does not load or verify never serves; the old one carries on
            return None, self._refuse_base(champion, exc)
        self._set_pending(store)
        return store, None

    def _refuse_base(self, champion: VersionRef, exc: Exception) -> str:
        self._refused_bases[champion.key] = f"{type(exc).__name__}: {exc}"
        self.metrics.refused_loads.labels(reason="base").inc()
        log.error("new base %s refused: %s", champion.key, self._refused_bases[champion.key])
        return self._refused_bases[champion.key]

    def _preload(self, pending: BaseStore, plan: base_switch.BasePlan) -> tuple[list[str], list[dict]]:
        """Load the new base's versions as their aliases name them (so the switch itself only waits for
        the last one); drop what the plan no longer names."""
        loaded, refused = [], []
        for (model, alias), ref in sorted(plan.on_new.items()):
            try:
                if self._ensure_loaded(ref, pending):
                    loaded.append(ref.key)
            except RefusedVersion as exc:
                refused.append(
                    {"model": model, "version": ref.version, "alias": alias, "reason": exc.reason, "error": exc.detail}
                )
        wanted = {ref.key for ref in plan.on_new.values()}
        with self._lock:
            stale = {k: pending.loaded.pop(k) for k in list(pending.loaded) if k not in wanted}
        if stale:
            pending.delete(list(stale.values()))
        return loaded, refused

    def _set_pending(self, store: BaseStore | None) -> None:
        old = self._pending
        if old is store:
            return
        if old is not None:
            self.metrics.base_info.remove(old.key, "pending")
        with self._lock:
            self._pending = store
        if store is not None:
            self.metrics.base_info.labels(version=store.key, state="pending").set(1)
        self.metrics.base_pending.set(0 if store is None else 1)

    def _stores(self) -> list[BaseStore]:
        """Every base in memory: the serving one, those old tables still being read hold, a pending one
        (caller holds the lock)."""
        stores = {id(t.base): t.base for t in self._live.values()}
        stores[id(self._table.base)] = self._table.base
        if self._pending is not None:
            stores[id(self._pending)] = self._pending
        return list(stores.values())

    def _collect(self) -> list[str]:
        """Evict what must go: every version of a base that left memory (an old base no live table
        serves, a pending base dropped or replaced), and idle versions of the serving base past the cap
        (least recently routed first). Returns the evicted keys."""
        with self._lock:
            serving, live_tables, stores = self._table.base, list(self._live.values()), self._stores()
            doomed: dict[BaseStore, list[str]] = {
                s: list(s.loaded) for s in self._known_stores if s not in stores and s.loaded
            }
            self._known_stores = stores
            for store in stores:
                if store is self._pending:
                    continue
                live = set(self._pinned).union(*(t.keys() for t in live_tables if t.base is store))
                idle = [k for k in store.loaded if k not in live]
                if store is serving:
                    room = max(0, self.max_loaded_adapters - (len(store.loaded) - len(idle)))
                    idle.sort(key=lambda k: self._last_routed.get(k, 0), reverse=True)
                    idle = idle[room:]
                    held = len(store.loaded) - len(idle)
                    self.metrics.cap_exceeded.set(int(held > self.max_loaded_adapters))
                if idle:
                    doomed[store] = idle
            names = {store: [store.loaded.pop(k) for k in keys] for store, keys in doomed.items()}
            held = {k for s in stores for k in s.loaded}
            self._last_routed = {k: t for k, t in self._last_routed.items() if k in held}
            self.metrics.loaded_adapters.set(sum(len(s.loaded) for s in stores))
        for store, batch in names.items():
            store.delete(batch)
        evicted = sorted(k for keys in doomed.values() for k in keys)
        if evicted:
            self.metrics.adapter_unloads.inc(len(evicted))
            log.info("unloaded %s", evicted)
        return evicted
