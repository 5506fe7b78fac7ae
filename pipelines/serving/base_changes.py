"""`AdapterServer`'s base changes: a new `<base_model>@champion` is loaded beside the serving base, its
adapters as their aliases name them, and every slot switches in one table swap once
`serving.base_switch.plan` says ready (see `serving.router`'s docstring).

An object the server holds. It owns the *pending* base (loaded, waiting for its adapters) and the bases
refused for good; it prepares a switch (`prepare`) and the server, which owns the routing tables, makes
it (`AdapterServer._toward`) and then calls `switched`. It shares the server's lock, passed in, because
eviction reads the pending base together with the tables (`serving.eviction`).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from pipelines.errors import RegistryError
from pipelines.serving import base_switch, loader
from pipelines.serving.base_store import BaseStore
from pipelines.serving.loader import RETRYABLE, RefusedVersion, Route, VersionRef
from pipelines.serving.metrics import ServingMetrics
from pipelines.serving.version_loads import VersionLoads, refusal

log = logging.getLogger("pipelines.serving.router")


@dataclass(frozen=True)
class Preparation:
    """What a refresh made ready for base version `champion`: its store (None: it cannot serve, `why`
    says why), the plan over what the aliases name, and this round's loads and refusals on it."""

    champion: VersionRef
    store: BaseStore | None
    plan: base_switch.BasePlan | None = None
    loaded: tuple[str, ...] = ()
    refused: tuple[dict, ...] = ()
    why: str | None = None

    def waiting(self) -> dict:
        """The refresh report's base "pending": the version and what it waits for."""
        if self.store is None:
            return {"version": self.champion.key, "dropped": [], "waiting_for": [f"{self.champion.key}: {self.why}"]}
        return {
            "version": self.champion.key,
            "waiting_for": list(self.plan.waiting),
            "dropped": list(self.plan.dropped),
        }


class BaseChanges:
    def __init__(self, registry: loader.Registry, metrics: ServingMetrics, lock: threading.Lock, loads: VersionLoads):
        self.registry, self.metrics, self.loads = registry, metrics, loads
        self._lock = lock  # the server's: eviction reads `pending` under it
        self._pending: BaseStore | None = None  # a new base@champion waiting for its adapters
        self._refused: dict[str, str] = {}  # base version key -> why it cannot serve

    @property
    def pending(self) -> BaseStore | None:
        """The new base waiting for its adapters, if any."""
        return self._pending

    def prepare(self, champion: VersionRef, resolved: dict[Route, VersionRef]) -> Preparation:
        """Load base version `champion` (once) and the versions of it that the aliases name, and plan the
        switch: ready once every watched champion names a version loaded on it."""
        store, why = self._pending_store(champion)
        if store is None:  # the new base cannot serve (now, or at all): nothing is held
            return Preparation(champion, None, why=why)
        plan = base_switch.plan(resolved, store.fingerprint)
        loaded, refused = self._preload(store, plan)
        # this round's refusals too: a download that failed (retried next time) has not loaded either
        unloadable = {
            **{f"{r['model']}:{r['version']}": r["reason"] for r in refused},
            **{k: r["reason"] for k, r in store.refused.items()},
        }
        plan = base_switch.plan(resolved, store.fingerprint, unloadable)
        return Preparation(champion, store, plan, tuple(loaded), tuple(refused))

    def switched(self, old: BaseStore) -> None:
        """The pending base serves now in place of `old`."""
        new = self._pending
        self._set_pending(None)
        self.metrics.base_info.remove(old.key, "serving")
        self.metrics.base_info.labels(version=new.key, state="serving").set(1)
        self.metrics.base_switches.inc()

    def drop_pending(self) -> None:
        """base@champion names the serving base again (or nothing): a pending base leaves memory."""
        self._set_pending(None)

    def _pending_store(self, champion: VersionRef) -> tuple[BaseStore | None, str | None]:
        """(the store of base version `champion`, loaded once; None) or (None, why it cannot serve): refused
        for good (remembered), or its download failed (tried again next refresh)."""
        if self._pending is not None and self._pending.key == champion.key:
            return self._pending, None
        self._set_pending(None)  # another new base (or none loadable) replaces a pending one
        if champion.key in self._refused:
            return None, self._refused[champion.key]
        try:
            store = BaseStore.load(self.registry, champion)
        except RegistryError as exc:
            if isinstance(exc.__cause__, RefusedVersion) and exc.__cause__.reason in RETRYABLE:
                log.warning("new base %s could not be downloaded (next refresh retries): %s", champion.key, exc)
                return None, f"download failed, retrying: {exc}"
            return None, self._refuse(champion, exc)
        except Exception as exc:  # a base that does not load or verify never serves; the old one carries on
            return None, self._refuse(champion, exc)
        self._set_pending(store)
        return store, None

    def _refuse(self, champion: VersionRef, exc: Exception) -> str:
        self._refused[champion.key] = f"{type(exc).__name__}: {exc}"
        self.metrics.refused_loads.labels(reason="base").inc()
        log.error("new base %s refused: %s", champion.key, self._refused[champion.key])
        return self._refused[champion.key]

    def _preload(self, pending: BaseStore, plan: base_switch.BasePlan) -> tuple[list[str], list[dict]]:
        """Load the new base's versions as their aliases name them (so the switch itself only waits for
        the last one); drop what the plan no longer names."""
        loaded, refused = [], []
        for (model, alias), ref in sorted(plan.on_new.items()):
            try:
                if self.loads.ensure_loaded(ref, pending):
                    loaded.append(ref.key)
            except RefusedVersion as exc:
                refused.append(refusal(model, alias, ref, exc))
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
