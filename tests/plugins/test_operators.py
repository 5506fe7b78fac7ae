"""Operators are thin: keyword-only, templated, no I/O at construction; refusals are typed."""
from __future__ import annotations

import inspect

import pytest
from airflow.sdk.exceptions import AirflowFailException

from ctr_airflow.operators import (MOVES, REGISTRY_POOL, CandidateRejected, GatedPromotionOperator,
                                   ModelMoveRefused, OverrideGateOperator, PromoteModelVersionOperator,
                                   ReleaseOperator, RevertModelVersionOperator, _version, asset_uri)


@pytest.mark.parametrize("cls, fields", [
    (RevertModelVersionOperator, {"model", "to_version", "reason"}),
    (PromoteModelVersionOperator, {"model", "version", "reason"}),
    (GatedPromotionOperator, {"registered", "policy_path"}),
    (OverrideGateOperator, {"model", "version", "reason"}),
    (ReleaseOperator, {"decision", "policy_path"}),
])
def test_keyword_only_and_templated(cls, fields):
    params = inspect.signature(cls.__init__).parameters
    own = [p for n, p in params.items() if n not in ("self", "kwargs")]
    assert own and all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in own)
    assert set(cls.template_fields) == fields


def test_construction_does_no_io(monkeypatch):
    # An unreachable tracking server: construction must not touch it.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    op = RevertModelVersionOperator(task_id="r", model="ctr_lora_x", reason="why not", to_version=None)
    assert op.model == "ctr_lora_x" and op.to_version is None


def test_refusals_fail_without_retry():
    assert issubclass(ModelMoveRefused, AirflowFailException)
    assert issubclass(CandidateRejected, AirflowFailException)


@pytest.mark.parametrize("raw, expected", [(None, None), ("", None), ("None", None), (3, "3"), ("4", "4")])
def test_version_param_normalisation(raw, expected):
    assert _version(raw) == expected


def test_moves_run_in_the_registry_pool_and_announce_the_alias_asset():
    op = PromoteModelVersionOperator(task_id="p", model="ctr_lora_x", version=2, reason="because")
    assert op.pool == REGISTRY_POOL and MOVES in op.outlets
    gate = GatedPromotionOperator(task_id="g", registered={})
    assert gate.pool == REGISTRY_POOL and MOVES in gate.outlets
    assert asset_uri("ctr_lora_feed", "champion") == "mlflow://ctr_lora_feed/champion"
