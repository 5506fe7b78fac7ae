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


@pytest.mark.parametrize("answer", [None, {}, {"chosen_options": []}, {"chosen_options": ["Maybe"]}])
def test_release_without_a_recorded_answer_is_refused_before_touching_the_registry(monkeypatch, answer):
    """The approval task marked success by hand (no HITL answer in XCom) must not release anything.
    The real answer path (Approve / Reject through the HITL API) is tests/e2e/test_approval_dag.py."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")   # any registry call would hang, then fail

    class AnsweredTI:   # the one TaskInstance method the check reads
        map_index = 1
        dag_id, run_id, task_id = "ctr_lora_retrain", "manual__x", "approval.release"

        def xcom_pull(self, task_ids, map_indexes):
            assert (task_ids, map_indexes) == ("approval.approve_release", 1)
            return answer

    op = ReleaseOperator(task_id="release", decision={"model": "ctr_lora_feed", "version": "3"},
                         approval_task_id="approval.approve_release")
    op.model = "ctr_lora_feed"
    with pytest.raises(ModelMoveRefused, match="no recorded answer from approval.approve_release"):
        op._approver({"ti": AnsweredTI()})
