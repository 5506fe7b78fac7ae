"""A server outage of a fixed length, in front of a real server (moto's S3, an `mlflow server`).

`Outage` is tests/pipelines/data/s3_faults.py's FaultProxy with a clock instead of a count: once armed,
the first request that matches starts the outage, and for `seconds` from then every request, whatever
it is, has its connection dropped (TCP RST), as a server that went away does; afterwards everything is
forwarded untouched again. Starting on a matching request (not on a timer) puts the outage exactly
in the step under test (the lake reads of a training, the registry reads of an evaluation) however
fast or slow the machine is.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from tests.pipelines.data.s3_faults import FaultProxy


class Outage(FaultProxy):
    def __init__(self, upstream: str, seconds: float):
        super().__init__(upstream, "reset", failures=sys.maxsize)
        self.seconds = seconds
        self.started: float | None = None  # time.monotonic() of the first dropped request
        self._armed: Callable[[str, str], bool] | None = None

    def arm(self, match: Callable[[str, str], bool] = lambda method, path: True) -> None:
        """The next request for which `match(method, path)` holds starts the outage."""
        with self._lock:
            self._armed = match

    def end(self) -> None:
        """The server is back now (a test that has seen what it needed need not wait out the rest)."""
        with self._lock:
            if self.started is not None:
                self.seconds = min(self.seconds, time.monotonic() - self.started)

    @property
    def over(self) -> bool:
        return self.started is not None and time.monotonic() >= self.started + self.seconds

    def _should_fault(self, method: str, path: str) -> bool:
        with self._lock:
            now = time.monotonic()
            if self.started is None and self._armed is not None and self._armed(method, path):
                self.started, self._armed = now, None
            if self.started is not None and now < self.started + self.seconds:
                self.faulted.append((method, path))
                return True
            self.forwarded.append((method, path))
            return False
