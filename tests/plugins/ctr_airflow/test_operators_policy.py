"""The operators on the real library and a real SQLite MLflow store (issue 13): the policy holds whatever
shape the DAG was parsed with (a gate task told to release under `approval: true` is refused), a
version a person rejected is refused by a promote and released only by an override, and the form's
text fields are coerced before use (a reason `12345` rendered to an int, one of 2,000 characters)."""

from __future__ import annotations

import json

import mlflow
import pytest
import yaml
from airflow.sdk.exceptions import AirflowSkipException

from ctr_airflow.operators import (
    GatedPromotionOperator,
    ModelMoveRefused,
    OverrideGateOperator,
    PromoteModelVersionOperator,
    ReleaseOperator,
)
from pipelines.promotion import aliases
from pipelines.registry import mlflow_io
from tests.conftest import use_store_copy
from tests.pipelines.promotion.test_aliases import MODEL, add_version
from tests.pipelines.promotion.test_gate import evaluation
from tests.plugins.ctr_airflow.test_operators import FakeTI, context

FP = "f" * 64
# Permissive thresholds: what is tested is the release after the gate, so the candidate passes it.
PERMISSIVE = {"promotion": "direct", "min_auc_first_run": 0.5, "latency_budget_ms": 60_000.0}


@pytest.fixture
def store(template_db, tmp_path, monkeypatch):
    """A fresh store with a serving base (FP) and v1 (passed its gate, first run) on it."""
    use_store_copy(template_db, tmp_path, monkeypatch)
    base = add_version("ctr_base", gate_passed=None, fingerprint=FP)
    mlflow_io.client().set_registered_model_alias("ctr_base", "champion", base)
    add_version(MODEL, base__fingerprint=FP, gate__champion_version="")
    yield tmp_path
    mlflow.set_tracking_uri(None)


def policy_file(tmp_path, **values) -> str:
    path = tmp_path / "gate_policy.yaml"
    path.write_text(yaml.safe_dump({**PERMISSIVE, **values}))
    return str(path)


def promote(reason="a good reason", version=1, **kwargs) -> PromoteModelVersionOperator:
    return PromoteModelVersionOperator(task_id="promote", model=MODEL, version=version, reason=reason, **kwargs)


def test_a_gate_task_that_would_release_under_an_approval_policy_is_refused(store):
    """The DAG was parsed without the approval step (an old parse, a policy changed since): the library
    still refuses the release. The gate's decision is recorded; nothing moves, nothing is announced."""
    op = GatedPromotionOperator(
        task_id="gate_and_promote",
        policy_path=policy_file(store, approval=True),
        registered={"model": MODEL, "version": 1, "evaluation": evaluation(champion=False)},
    )
    ctx = context()
    with pytest.raises(ModelMoveRefused, match="needs a recorded approval"):
        op.execute(ctx)
    assert aliases.current(MODEL) is None and aliases.history(MODEL, None) == []
    assert ctx["outlet_events"].added == [] and "needs a recorded approval" in ctx["ti"].pushed["error"]["error"]
    assert mlflow_io.get_version(MODEL, "1").tags["gate.passed"] == "true"


def test_a_promote_by_hand_needs_the_approval_the_policy_asks_for(store):
    with pytest.raises(ModelMoveRefused, match="promotion of ctr_lora_feed refused: .*needs a recorded approval"):
        promote(policy_path=policy_file(store, approval=True)).execute(context())
    assert aliases.current(MODEL) is None
    promote(policy_path=policy_file(store, approval=False)).execute(context())
    assert aliases.current(MODEL) == "1"


def test_a_rejected_version_is_refused_by_promote_and_released_by_an_override(store):
    ti = FakeTI({"chosen_options": ["Reject"], "responded_by_user": {"name": "bob"}, "responded_at": "2024-01-05"})
    release = ReleaseOperator(
        task_id="release",
        decision={"model": MODEL, "version": "1"},
        policy_path=policy_file(store, approval=True),
        approval_task_id="approval.approve_release",
    )

    with pytest.raises(AirflowSkipException, match="rejected by bob"):
        release.execute(context(ti))
    with pytest.raises(ModelMoveRefused, match="v1 was rejected by bob"):
        promote().execute(context())  # the shipped policy: no approval asked for
    assert aliases.current(MODEL) is None

    ctx = context()
    OverrideGateOperator(task_id="override", model=MODEL, version=1, reason="bob's concern is fixed").execute(ctx)
    assert aliases.current(MODEL) == "1" and ctx["outlet_events"].added == [
        ("mlflow://ctr_lora_feed/champion", "override", "1")
    ]
    assert json.loads(mlflow_io.get_version(MODEL, "1").tags["gate.override"])["rejection"]["by"] == "bob"


@pytest.mark.parametrize("reason, recorded", [(12345, "12345"), (1.5, "1.5"), ("12345", "12345")])
def test_a_reason_rendered_to_a_number_is_recorded_as_text(store, reason, recorded):
    """`render_template_as_native_obj` renders "{{ params.reason }}" = "12345" to the int 12345."""
    promote(reason=reason).execute(context())
    assert aliases.history(MODEL)[-1]["reason"] == recorded and aliases.current(MODEL) == "1"


@pytest.mark.parametrize("reason", [None, ["a", "list"], True])
def test_a_reason_that_is_not_text_is_a_refusal_not_a_crash(store, reason):
    with pytest.raises(ModelMoveRefused, match="reason must be text"):
        promote(reason=reason).execute(context())
    assert aliases.current(MODEL) is None


def test_a_reason_of_2000_characters_is_refused_and_nothing_moves(store):
    ctx = context()
    with pytest.raises(ModelMoveRefused, match="a reason is at most 1000 characters \\(got 2000\\)"):
        promote(reason="x" * 2000).execute(ctx)
    assert aliases.current(MODEL) is None and aliases.history(MODEL, None) == []
    assert "at most 1000" in ctx["ti"].pushed["error"]["error"]
