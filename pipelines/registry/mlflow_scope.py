"""A temporary MLflow tracking and registry URI, and temporary environment variables, for one `with` block.

Why process-wide state at all: what runs inside (the flows, `serving.demo`, `promotion.aliases`, the serving
code) uses MLflow's fluent API and `MlflowClient()` without a URI, as the CLI does, so it reads the process's
URIs and environment. Code that can pass `MlflowClient(tracking_uri=…, registry_uri=…)`, or start a
subprocess with an environment of its own, should do that instead; this module is for the rest, and it is
the only place that saves and restores those settings.

How MLflow 3 holds a URI (mlflow/tracking/_tracking_service/utils.py and _model_registry/utils.py, 3.17):
in two places, a module global and an environment variable. `get_tracking_uri()` / `get_registry_uri()`
return the global when it is set, else the variable, else a default, and no public function says which one
it was. `set_tracking_uri(uri)` sets the global and exports MLFLOW_TRACKING_URI; `set_tracking_uri(None)`
clears the global and unsets the variable. `set_registry_uri(uri)` sets the global and exports
MLFLOW_REGISTRY_URI; `set_registry_uri(None)` clears the global and leaves the variable as it was. So the
public setters can put either global back, None included, but only a private read tells what it was: a
global equal to the variable and a global that is unset resolve alike until the variable changes (a test's
monkeypatch restoring it, say), and then they part. `temporary_mlflow` reads the two globals (never writes
them), restores them through the public setters, then restores the variables, which those setters overwrite.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping

import mlflow
from mlflow.tracking._model_registry import utils as registry_utils
from mlflow.tracking._tracking_service import utils as tracking_utils

TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
REGISTRY_URI_ENV = "MLFLOW_REGISTRY_URI"


@contextlib.contextmanager
def preserved_env(names: Iterable[str]) -> Iterator[None]:
    """On leaving (an exception included), each named environment variable is what it was on entering:
    the same value, or unset if it was unset."""
    saved = {name: os.environ.get(name) for name in names}
    try:
        yield
    finally:
        for name, value in saved.items():
            _put_env(name, value)


@contextlib.contextmanager
def temporary_env(values: Mapping[str, str | None]) -> Iterator[None]:
    """For the block, each variable of `values` holds its value (None: unset); afterwards, what it was."""
    with preserved_env(values):
        for name, value in values.items():
            _put_env(name, value)
        yield


@contextlib.contextmanager
def preserved_mlflow(env_names: Iterable[str] = ()) -> Iterator[None]:
    """On leaving (an exception included), both URI globals, MLFLOW_TRACKING_URI / MLFLOW_REGISTRY_URI and each
    variable of `env_names` are exactly what they were on entering, "unset" included."""
    saved_tracking, saved_registry = _uri_globals()
    # outermost, so the variables are put back after the setters below have overwritten them
    with preserved_env({*env_names, TRACKING_URI_ENV, REGISTRY_URI_ENV}):
        try:
            yield
        finally:
            mlflow.set_tracking_uri(saved_tracking)
            mlflow.set_registry_uri(saved_registry)


@contextlib.contextmanager
def temporary_mlflow(
    tracking_uri: str, *, registry_uri: str | None = None, env: Mapping[str, str | None] | None = None
) -> Iterator[None]:
    """For the block, MLflow tracks to `tracking_uri` and registers to `registry_uri` (default: the tracking
    URI), both as MLflow's globals and as MLFLOW_TRACKING_URI / MLFLOW_REGISTRY_URI (so subprocesses inherit
    them), and the variables of `env` hold their values (None: unset). Afterwards (an exception included)
    both URI globals and every one of those variables are exactly what they were, "unset" included.

    A variable that code inside sets without being named here (mlflow.set_experiment exports
    MLFLOW_EXPERIMENT_ID) stays set: name it in `env` (None) to have it put back."""
    registry_uri = registry_uri or tracking_uri
    env = {**(env or {}), TRACKING_URI_ENV: tracking_uri, REGISTRY_URI_ENV: registry_uri}
    with preserved_mlflow(env):
        for name, value in env.items():
            _put_env(name, value)
        mlflow.set_tracking_uri(tracking_uri)
        mlflow.set_registry_uri(registry_uri)
        yield


def _uri_globals() -> tuple[str | None, str | None]:
    """MLflow's tracking and registry URI globals, None where unset. Private attributes, read only: the
    public getters fall back to the environment and a default, so they cannot tell "unset" (module
    docstring); checked against MLflow 3.17 by tests/pipelines/registry/test_mlflow_scope.py."""
    return tracking_utils._tracking_uri, registry_utils._registry_uri


def _put_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
