"""A slot retrain (pipelines.flows.retrain.run) in a process of its own that stops at a chosen point, so
that a test can kill -9 it there (the worker of test_faults.py).

    python -m tests.pipelines.flows.crash_retrain ARGS_PICKLE POINT MARKER

ARGS_PICKLE: a pickle of (cfg, policy, lake_uri, end_day, slot), written by the test (the tracking URI
and CTR_CODE_VERSION come from the environment). POINT:

* `after_train`: the adapter is trained and logged (its run and logged model exist); nothing is registered.
* `after_register`: `MlflowClient.create_model_version` returned (the version and its lineage tags
  exist), its `candidate` alias is not set and its model card not published.
* `before_gate`: registration is complete; the gate is about to write its decision (`gate.passed`).

At that point the process touches MARKER and sleeps; the test then sends SIGKILL. Nothing is faked:
every registry call before the stop is the real one, and the process really dies there.
"""

from __future__ import annotations

import pickle
import sys
import time
from pathlib import Path

from mlflow import MlflowClient

from pipelines.flows import retrain

POINTS = ("after_train", "after_register", "before_gate")


def _stop(marker: str) -> None:
    Path(marker).touch()
    time.sleep(600)  # killed here


def stop_at(point: str, marker: str) -> None:
    if point == "after_train":  # the flow's next step after `adapter.train` returned
        retrain.evaluate = lambda *args, **kwargs: _stop(marker)
    elif point == "after_register":
        real_create = MlflowClient.create_model_version

        def create_then_stop(self, *args, **kwargs):
            real_create(self, *args, **kwargs)
            _stop(marker)

        MlflowClient.create_model_version = create_then_stop
    else:
        real_tag = MlflowClient.set_model_version_tag

        def stop_before_gate_tag(self, name, version, key, value):
            if key == "gate.passed" and value != "pending":
                _stop(marker)
            return real_tag(self, name, version, key, value)

        MlflowClient.set_model_version_tag = stop_before_gate_tag


def main(args_pickle: str, point: str, marker: str) -> None:
    if point not in POINTS:
        raise SystemExit(f"unknown point {point!r}; expected one of {POINTS}")
    cfg, policy, lake_uri, end_day, slot = pickle.loads(Path(args_pickle).read_bytes())
    stop_at(point, marker)
    retrain.run(cfg, policy, lake_uri, end_day, slot, actor="doomed")
    raise SystemExit("the retrain finished: it should have been killed first")


if __name__ == "__main__":
    main(*sys.argv[1:4])
