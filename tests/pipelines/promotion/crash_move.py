"""One alias move in a process of its own that stops at a chosen point, so that a test can kill -9 it there
(the worker of test_write_ahead.py).

    python -m tests.pipelines.promotion.crash_move TRACKING_URI MODEL VERSION OP_ID POINT MARKER

POINT: `before_alias` (the history entry is written ahead, the alias has not moved) or `after_alias`
(the alias has moved, its entry is not marked done). At that point the process touches MARKER and
sleeps; the test then sends SIGKILL. Nothing is faked: the registry call before the stop is the real
one, and the process really dies with the lock held and the move half done.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import mlflow
from mlflow import MlflowClient

from pipelines.promotion import aliases


def stop_at(point: str, marker: str) -> None:
    real = MlflowClient.set_registered_model_alias

    def set_alias_then_stop(self, *args, **kwargs):
        if point == "after_alias":
            real(self, *args, **kwargs)
        Path(marker).touch()
        time.sleep(600)  # killed here

    MlflowClient.set_registered_model_alias = set_alias_then_stop


def main(uri: str, model: str, version: str, op_id: str, point: str, marker: str) -> None:
    if point not in ("before_alias", "after_alias"):
        raise SystemExit(f"unknown point {point!r}")
    mlflow.set_tracking_uri(uri)
    stop_at(point, marker)
    aliases.promote(model, version, reason=f"crash test {op_id}", actor="doomed", op_id=op_id)
    raise SystemExit("the move finished: it should have been killed first")


if __name__ == "__main__":
    main(*sys.argv[1:7])
