"""`mlflow_scope`: a temporary MLflow tracking / registry URI and environment, put back exactly afterwards.

"Exactly" is MLflow's two places per URI (a module global, read here through MLflow's private attributes,
and an environment variable) plus every variable the scope was given, "unset" included: a URI global left
equal to the variable instead of unset resolves alike only until the variable changes."""

from __future__ import annotations

import os

import mlflow
import pytest
from mlflow.tracking._model_registry import utils as registry_utils
from mlflow.tracking._tracking_service import utils as tracking_utils

from pipelines.registry.mlflow_scope import preserved_env, preserved_mlflow, temporary_env, temporary_mlflow

TRACKING, REGISTRY = "MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI"
EXTRA, CLEARED = "CTR_SCOPE_TEST_EXTRA", "CTR_SCOPE_TEST_CLEARED"
NAMES = (TRACKING, REGISTRY, EXTRA, CLEARED)

# what the process holds before the scope: (tracking global, registry global, environment variables)
STARTS = {
    "nothing set": (None, None, {}),
    "set by MLflow's setters": (
        "sqlite:///a.db",
        "sqlite:///b.db",
        {TRACKING: "sqlite:///a.db", REGISTRY: "sqlite:///b.db"},
    ),
    "only the variables": (None, None, {TRACKING: "sqlite:///env.db", REGISTRY: "sqlite:///env-r.db", CLEARED: "x"}),
    "globals and variables disagree": ("sqlite:///a.db", "sqlite:///b.db", {TRACKING: "sqlite:///env.db", EXTRA: "y"}),
}


class Boom(Exception):
    pass


@pytest.fixture
def start(request):
    """The process in the state `request.param` names; afterwards both globals unset and the variables as
    they were before the test."""
    tracking, registry, env = STARTS[request.param]
    # Not monkeypatch: MLflow's setters export the variables, so a monkeypatch.delenv after them would put the
    # setters' URIs back at teardown, and a later test of the worker would register to sqlite:///b.db.
    # preserved_env is tested on its own below.
    with preserved_env(NAMES):
        mlflow.set_tracking_uri(tracking)
        mlflow.set_registry_uri(registry)
        for name in NAMES:  # after the setters, which export the variables
            os.environ.pop(name, None)
        os.environ.update(env)
        yield
        mlflow.set_tracking_uri(None)
        mlflow.set_registry_uri(None)


def observed() -> tuple:
    return tracking_utils._tracking_uri, registry_utils._registry_uri, {n: os.environ.get(n) for n in NAMES}


def scope():
    return temporary_mlflow("sqlite:///scope.db", registry_uri="sqlite:///scope-r.db", env={EXTRA: "1", CLEARED: None})


@pytest.mark.parametrize("start", list(STARTS), indirect=True)
def test_inside_the_block_mlflow_and_the_variables_are_the_given_ones(start):
    with scope():
        assert mlflow.get_tracking_uri() == "sqlite:///scope.db"
        assert mlflow.get_registry_uri() == "sqlite:///scope-r.db"
        assert {n: os.environ.get(n) for n in NAMES} == {
            TRACKING: "sqlite:///scope.db",  # exported: a subprocess started inside inherits the scope
            REGISTRY: "sqlite:///scope-r.db",
            EXTRA: "1",
            CLEARED: None,
        }


@pytest.mark.parametrize("start", list(STARTS), indirect=True)
def test_afterwards_the_uri_globals_and_variables_are_exactly_what_they_were(start):
    before = observed()
    with scope():
        assert observed() != before
    assert observed() == before


@pytest.mark.parametrize("start", list(STARTS), indirect=True)
def test_an_exception_in_the_block_restores_them_too(start):
    before = observed()
    with pytest.raises(Boom), scope():
        raise Boom
    assert observed() == before


@pytest.mark.parametrize("start", ["nothing set"], indirect=True)
def test_the_registry_is_the_tracking_uri_unless_given(start):
    with temporary_mlflow("sqlite:///scope.db"):
        assert mlflow.get_registry_uri() == "sqlite:///scope.db" == os.environ[REGISTRY]


@pytest.mark.parametrize("start", ["globals and variables disagree"], indirect=True)
def test_what_the_block_itself_moves_is_undone_and_nested_scopes_unwind_in_order(start):
    before = observed()
    with temporary_mlflow("sqlite:///outer.db", env={EXTRA: "outer"}):
        outer = observed()
        with temporary_mlflow("sqlite:///inner.db", env={EXTRA: "inner"}):
            mlflow.set_tracking_uri("sqlite:///moved.db")
            mlflow.set_registry_uri("sqlite:///moved-r.db")
            os.environ[EXTRA] = "moved"
        assert observed() == outer
    assert observed() == before


@pytest.mark.parametrize("start", list(STARTS), indirect=True)
def test_preserved_mlflow_undoes_uris_and_variables_the_block_moved_by_itself(start):
    """What tests/conftest.py wraps every test in: a test that points MLflow elsewhere and never points it back
    leaves the next test of the worker where it found the process."""
    before = observed()
    with pytest.raises(Boom), preserved_mlflow([EXTRA]):
        mlflow.set_tracking_uri("sqlite:///moved.db")
        mlflow.set_registry_uri("sqlite:///moved-r.db")
        os.environ[EXTRA] = "moved"
        raise Boom
    assert observed() == before


@pytest.mark.parametrize("start", ["nothing set"], indirect=True)
def test_mlflows_setters_behave_as_the_scope_assumes(start):
    """The module docstring's reading of MLflow 3: if this fails, MLflow changed and the restore order (the
    globals through the setters, then the variables) must be checked again."""
    mlflow.set_tracking_uri("sqlite:///t.db")
    mlflow.set_registry_uri("sqlite:///r.db")
    assert (os.environ[TRACKING], os.environ[REGISTRY]) == ("sqlite:///t.db", "sqlite:///r.db")
    mlflow.set_tracking_uri(None)
    mlflow.set_registry_uri(None)
    assert tracking_utils._tracking_uri is None and registry_utils._registry_uri is None
    assert TRACKING not in os.environ, "set_tracking_uri(None) unsets its variable"
    assert os.environ[REGISTRY] == "sqlite:///r.db", "set_registry_uri(None) leaves its variable"
    assert mlflow.get_registry_uri() == "sqlite:///r.db", "an unset global falls back to the variable"


def test_temporary_env_sets_and_unsets_for_the_block_only(monkeypatch):
    monkeypatch.setenv(CLEARED, "was set")
    monkeypatch.delenv(EXTRA, raising=False)
    with pytest.raises(Boom), temporary_env({EXTRA: "1", CLEARED: None}):
        assert (os.environ.get(EXTRA), os.environ.get(CLEARED)) == ("1", None)
        raise Boom
    assert (os.environ.get(EXTRA), os.environ.get(CLEARED)) == (None, "was set")


def test_preserved_env_removes_a_named_variable_the_block_created(monkeypatch):
    monkeypatch.delenv(EXTRA, raising=False)
    with preserved_env([EXTRA]):
        os.environ[EXTRA] = "created inside"
    assert EXTRA not in os.environ
