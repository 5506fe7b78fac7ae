"""Keeping a running AdapterServer on the registry's aliases, without a restart.

A `Follower` refreshes the server every `interval_s` (polling: always on, the fallback, re-reading every
watched alias) and at once when `poke()`d (a registry webhook, `serving.http`), re-reading only the
aliases the webhooks named (one registry call instead of one per watched alias; the payload's version
is never used, so a forged call still cannot choose a route). Refreshes run on one background thread, one at a
time; pokes that arrive during a refresh are folded into one more refresh right after it, so a burst
of alias moves costs at most two refreshes and the last move is never missed.

A failed refresh (registry unreachable, a download that broke off) changes nothing: the server keeps
serving its current routes and the next tick tries again. `ready()` is what `GET /healthz` reports.
"""

from __future__ import annotations

import logging
import threading
import time

from pipelines.serving.router import AdapterServer

log = logging.getLogger(__name__)


class Follower:
    def __init__(self, server: AdapterServer, *, interval_s: float = 10.0):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.server, self.interval_s = server, float(interval_s)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._trigger = "poll"
        self._hints: set[tuple[str, str]] | None = set()  # routes pokes named; None: a full read is due
        self._lock = threading.Lock()
        self._state: dict = {"ok_at": None, "error": None, "error_at": None, "report": None, "refreshes": 0}

    def start(self) -> Follower:
        self._thread = threading.Thread(target=self._loop, name="registry-follower", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def poke(self, trigger: str = "webhook", route: tuple[str, str] | None = None) -> None:
        """Refresh as soon as the thread is free (a webhook said an alias moved). With `route`
        ((model, alias) the webhook named), that refresh re-reads only the routes named since the last
        one; a poke without a route asks for a full read."""
        with self._lock:
            if route is None:
                self._hints = None
            elif self._hints is not None:
                self._hints.add(route)
            self._trigger = trigger
        self._wake.set()

    def _loop(self) -> None:
        last_full = time.monotonic()
        while not self._stop.is_set():
            poked = self._wake.wait(max(0.0, last_full + self.interval_s - time.monotonic()))
            if self._stop.is_set():
                return
            self._wake.clear()  # before refreshing: a poke during the refresh triggers the next one
            with self._lock:
                hints, self._hints = self._hints, set()
            # a full read every interval, pokes or not: a webhook that never arrived is caught by it
            if poked and hints and time.monotonic() - last_full < self.interval_s:
                if self.refresh(self._trigger, only=hints) is None:
                    with self._lock:
                        self._hints = None  # the named routes were not read: the next refresh reads all
            else:
                self.refresh(self._trigger if poked else "poll")
                last_full = time.monotonic()

    def refresh(self, trigger: str = "manual", only=None) -> dict | None:
        """One refresh now, on the caller's thread (re-reading `only` those routes, when given); the
        report, or None when it failed (logged, recorded)."""
        metrics = self.server.metrics
        start = time.perf_counter()
        try:
            report = self.server.refresh(only=only)
        except Exception as exc:  # the server keeps its routes; the next tick retries
            log.error(
                "refresh (%s) failed, still serving %s: %s: %s", trigger, self.server.routes(), type(exc).__name__, exc
            )
            metrics.refreshes.labels(trigger=trigger, outcome="error").inc()
            with self._lock:
                self._state.update(error=f"{type(exc).__name__}: {exc}", error_at=time.time())
            return None
        metrics.refreshes.labels(trigger=trigger, outcome="ok").inc()
        elapsed_ms = 1000 * (time.perf_counter() - start)
        if report["swapped"] or report["refused"]:
            log.info(
                "refresh (%s) in %.1f ms: routes %s, loaded %s, refused %s",
                trigger,
                elapsed_ms,
                report["routes"],
                report["loaded"],
                [r["version"] for r in report["refused"]],
            )
        now = time.time()
        metrics.last_refresh.set(now)
        with self._lock:
            self._state.update(
                ok_at=now, error=None, error_at=None, report=report, refreshes=self._state["refreshes"] + 1
            )
        return report

    def state(self) -> dict:
        """JSON-safe: when the registry was last read, the last error since, the last report."""
        with self._lock:
            return dict(self._state)

    def ready(self) -> tuple[bool, str]:
        """(ready, why): ready once a refresh has read the registry and every alias it found serves a
        version (the one it names, or the previous one when that was refused)."""
        state = self.state()
        report = state["report"]
        if report is None:
            return False, f"no refresh has read the registry yet ({state['error'] or 'starting'})"
        routes = report["routes"]
        unserved = sorted({f"{r['model']}@{r['alias']}" for r in report["refused"]} - set(routes))
        if unserved:
            return False, f"aliases with no loadable version: {unserved}"
        return True, "every watched alias is loaded"
