"""Operators are thin: keyword-only, templated, no I/O at construction; refusals are typed; each
calls one library entry function (checked here with the library replaced by recorders)."""

from __future__ import annotations

import inspect

import pytest
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

import pipelines.config
from ctr_airflow import dag_defaults
from ctr_airflow.operators import (
    MOVES,
    REGISTRY_POOL,
    GatedPromotionOperator,
    ModelMoveRefused,
    OverrideGateOperator,
    PromoteCanaryOperator,
    PromoteModelVersionOperator,
    ReleaseOperator,
    RevertModelVersionOperator,
    WithdrawCanaryOperator,
    _version,
    asset_uri,
    registry_write,
)
from pipelines.errors import PipelineError, PromotionError
from pipelines.promotion import aliases
from pipelines.promotion import release as library


@pytest.mark.parametrize(
    "cls, fields",
    [
        (RevertModelVersionOperator, {"model", "to_version", "reason"}),
        (PromoteModelVersionOperator, {"model", "version", "reason", "policy_path"}),
        (GatedPromotionOperator, {"registered", "policy_path"}),
        (OverrideGateOperator, {"model", "version", "reason"}),
        (ReleaseOperator, {"decision", "policy_path"}),
        (PromoteCanaryOperator, {"model", "reason"}),
        (WithdrawCanaryOperator, {"model", "reason"}),
    ],
)
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


@pytest.mark.parametrize("raw, expected", [(None, None), ("", None), ("None", None), (3, "3"), ("4", "4")])
def test_version_param_normalisation(raw, expected):
    assert _version(raw) == expected


@pytest.mark.parametrize("raw", [0, -2, "two", "1.5", True])
def test_a_version_that_is_not_a_positive_integer_is_refused_as_a_pipeline_error(raw):
    with pytest.raises(PipelineError, match="positive integer"):  # inside move(): becomes ModelMoveRefused
        _version(raw)


def test_registry_writes_wait_in_the_one_registry_pool():
    assert REGISTRY_POOL is dag_defaults.REGISTRY_POOL  # operators and TaskFlow tasks share one pool
    assert registry_write() == {"pool": REGISTRY_POOL, "outlets": [MOVES]}
    assert registry_write(moves=False) == {"pool": REGISTRY_POOL}


def test_moves_run_in_the_registry_pool_and_announce_the_alias_asset():
    op = PromoteModelVersionOperator(task_id="p", model="ctr_lora_x", version=2, reason="because")
    assert op.pool == REGISTRY_POOL and MOVES in op.outlets
    for cls in (PromoteCanaryOperator, WithdrawCanaryOperator):
        op = cls(task_id="c", model="ctr_lora_x", reason="because")
        assert op.pool == REGISTRY_POOL and MOVES in op.outlets
    gate = GatedPromotionOperator(task_id="g", registered={})
    assert gate.pool == REGISTRY_POOL and MOVES in gate.outlets
    assert asset_uri("ctr_lora_feed", "champion") == "mlflow://ctr_lora_feed/champion"


@pytest.mark.parametrize("answer", [None, {}, {"chosen_options": []}, {"chosen_options": ["Maybe"]}])
def test_release_without_a_recorded_answer_is_refused_before_touching_the_registry(monkeypatch, answer):
    """The approval task marked success by hand (no HITL answer in XCom) must not release anything.
    The real answer path (Approve / Reject through the HITL API) is tests/e2e/test_approval_dag.py."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # any registry call would hang, then fail

    class AnsweredTI:  # the one TaskInstance method the check reads
        map_index = 1
        dag_id, run_id, task_id = "ctr_lora_retrain", "manual__x", "approval.release"

        def xcom_pull(self, task_ids, map_indexes):
            assert (task_ids, map_indexes) == ("approval.approve_release", 1)
            return answer

    op = ReleaseOperator(
        task_id="release",
        decision={"model": "ctr_lora_feed", "version": "3"},
        approval_task_id="approval.approve_release",
    )
    op.model = "ctr_lora_feed"
    with pytest.raises(ModelMoveRefused, match="no recorded answer from approval.approve_release"):
        op._approver({"ti": AnsweredTI()})


# ----------------------------------------------------------------------------- execute, library replaced
class FakeTI:
    dag_id, run_id, task_id, map_index = "ctr_lora_retrain", "manual__x", "gate_and_promote", 2

    def __init__(self, answer=None):
        self.answer, self.pushed = answer, {}

    def xcom_push(self, key, value):
        self.pushed[key] = value

    def xcom_pull(self, task_ids, map_indexes):
        return self.answer


class Events:
    """context["outlet_events"]: records the asset events an operator adds."""

    def __init__(self):
        self.added = []

    def __getitem__(self, alias):
        assert alias == MOVES
        return self

    def add(self, asset, extra):
        self.added.append((asset.uri, extra["kind"], extra["to_version"]))


def context(ti=None) -> dict:
    return {"ti": ti or FakeTI(), "outlet_events": Events(), "dag_run": None}


def move(model="ctr_lora_feed", alias="champion", to="2", kind="promote", moved=True, **extra) -> dict:
    return {
        "moved": moved,
        "model": model,
        "alias": alias,
        "kind": kind,
        "from_version": "1",
        "to_version": to,
        "reason": "r",
        "actor": "airflow",
        **extra,
    }


OP_ID = "airflow:ctr_lora_retrain/manual__x/gate_and_promote[2]"


@pytest.fixture
def policy(monkeypatch):
    monkeypatch.setattr(pipelines.config, "load_gate_policy", lambda path=None: "the policy")
    return "the policy"


@pytest.mark.parametrize("release", [True, False])
def test_gated_promotion_is_one_call_of_gate_and_release(monkeypatch, policy, release):
    calls = []

    def gate_and_release(policy, model, version, evaluation, actor, op_id, *, release_on_pass, on_move):
        calls.append((policy, model, version, evaluation, actor, op_id, release_on_pass))
        if release_on_pass:
            on_move(move())
        return {"passed": True, "model": model, "version": version, "promoted": release_on_pass}

    monkeypatch.setattr(library, "gate_and_release", gate_and_release)
    ctx = context()
    op = GatedPromotionOperator(
        task_id="gate_and_promote",
        release=release,
        registered={"model": "ctr_lora_feed", "version": 2, "evaluation": {"e": 1}},
    )
    out = op.execute(ctx)
    assert calls == [("the policy", "ctr_lora_feed", "2", {"e": 1}, "airflow", OP_ID, release)]
    assert out["promoted"] is release
    assert ctx["outlet_events"].added == ([("mlflow://ctr_lora_feed/champion", "promote", "2")] if release else [])


# AirflowFailException: the task instance fails without using its retries (a rejection is not transient)
@pytest.mark.parametrize("fail_on_reject, raised", [(False, AirflowSkipException), (True, AirflowFailException)])
def test_a_rejected_candidate_is_pushed_and_ends_the_task(monkeypatch, policy, fail_on_reject, raised):
    decision = {"passed": False, "champion_version": "1", "promoted": False}
    monkeypatch.setattr(library, "gate_and_release", lambda *a, **k: decision)
    ctx = context()
    op = GatedPromotionOperator(
        task_id="gate_and_promote",
        fail_on_reject=fail_on_reject,
        registered={"model": "ctr_lora_feed", "version": "2", "evaluation": {}},
    )
    with pytest.raises(raised, match="@champion stays at v1"):
        op.execute(ctx)
    assert ctx["ti"].pushed == {"decision": decision} and ctx["outlet_events"].added == []


@pytest.mark.parametrize("answer", ["Approve", "Reject"])
def test_release_records_the_answer_through_the_library(monkeypatch, policy, answer):
    recorded, released = [], []
    monkeypatch.setattr(library, "record_approval", lambda *a, **k: recorded.append((a, k)))
    monkeypatch.setattr(library, "release", lambda *a, **k: released.append((a, k)) or move())
    ti = FakeTI({"chosen_options": [answer], "responded_by_user": {"name": "alice"}, "responded_at": "2024-01-05"})
    op = ReleaseOperator(
        task_id="release",
        decision={"model": "ctr_lora_feed", "version": "3"},
        approval_task_id="approval.approve_release",
    )
    if answer == "Reject":
        with pytest.raises(AirflowSkipException, match="rejected by alice"):
            op.execute(context(ti))
    else:
        op.execute(context(ti))
    assert recorded == [(("ctr_lora_feed", "3"), {"answer": answer, "by": "alice", "at": "2024-01-05", "task": OP_ID})]
    # the release reads the approver from the record on the version, not from the operator
    assert [a[1:] for a, k in released] == ([("ctr_lora_feed", "3")] if answer == "Approve" else [])


def test_promote_canary_announces_both_moves(monkeypatch):
    calls = []

    def promote_canary(model, reason, actor, op_id):
        calls.append((model, reason, actor, op_id))
        return {**move(model), "withdrawn": move(model, alias="canary", to="", kind="withdraw")}

    monkeypatch.setattr(aliases, "promote_canary", promote_canary)
    monkeypatch.setattr(aliases, "withdraw_canary", lambda model, reason, actor, op_id: move(model, moved=False))
    ctx = context()
    out = PromoteCanaryOperator(task_id="promote_canary", model="ctr_lora_feed", reason="healthy").execute(ctx)
    assert out["withdrawn"]["kind"] == "withdraw" and calls == [("ctr_lora_feed", "healthy", "airflow", OP_ID)]
    assert ctx["outlet_events"].added == [
        ("mlflow://ctr_lora_feed/champion", "promote", "2"),
        ("mlflow://ctr_lora_feed/canary", "withdraw", ""),
    ]
    ctx = context()
    WithdrawCanaryOperator(task_id="withdraw_canary", model="ctr_lora_feed", reason="nothing there").execute(ctx)
    assert ctx["outlet_events"].added == []  # nothing moved, nothing announced


def test_a_refused_move_is_pushed_and_fails_without_retry(monkeypatch):
    def refuse(*a, **k):
        raise PromotionError("ctr_lora_feed has no @canary to promote")

    monkeypatch.setattr(aliases, "promote_canary", refuse)
    ctx = context()
    # AirflowFailException: the task instance fails without using its retries; a refusal is not transient
    with pytest.raises(AirflowFailException, match="canary promotion of ctr_lora_feed refused: .*no @canary"):
        PromoteCanaryOperator(task_id="promote_canary", model="ctr_lora_feed", reason="healthy").execute(ctx)
    assert ctx["ti"].pushed == {"error": {"model": "ctr_lora_feed", "error": "ctr_lora_feed has no @canary to promote"}}


HELD = "ctr_lora_feed v4 passed its gate but is held: canary v2 is still being watched ... It is not queued"


def held_move() -> dict:
    return move(alias="canary", to="2", moved=False, held=True, held_version="4", reason=HELD)


class Log:
    """The operator's task log (Airflow's structured logger is not pytest's): what it was told, by level."""

    def __init__(self):
        self.lines = []

    def warning(self, msg, *args):
        self.lines.append(("warning", msg % args))

    def info(self, msg, *args):
        self.lines.append(("info", msg % args))


def test_an_approved_release_that_is_held_says_so_and_ends_skipped(monkeypatch):
    """Held means told: the task log, the task's state and an Asset event name what is held and why."""
    monkeypatch.setattr(library, "record_approval", lambda *a, **k: None)
    monkeypatch.setattr(library, "release", lambda *a, **k: held_move())
    ctx = context(FakeTI({"chosen_options": ["Approve"], "responded_by_user": {"name": "alice"}}))
    op = ReleaseOperator(
        task_id="release",
        decision={"model": "ctr_lora_feed", "version": "4"},
        approval_task_id="approval.approve_release",
    )
    log = Log()
    monkeypatch.setattr(ReleaseOperator, "log", log)
    with pytest.raises(AirflowSkipException, match="held: .*canary v2 is still being watched .*not queued"):
        op.execute(ctx)
    assert ctx["outlet_events"].added == [("mlflow://ctr_lora_feed/held", "held", "4")]
    assert ("warning", f"HELD ctr_lora_feed v4: {HELD}") in log.lines


def test_a_gated_release_that_is_held_ends_skipped_with_its_decision(monkeypatch, policy):
    def gate_and_release(*a, on_move, **k):
        on_move(held_move())
        return {
            "passed": True,
            "promoted": False,
            "release": {"alias": "canary", "moved": False, "held": True, "reason": HELD},
        }

    monkeypatch.setattr(library, "gate_and_release", gate_and_release)
    ctx = context()
    op = GatedPromotionOperator(
        task_id="gate_and_promote", registered={"model": "ctr_lora_feed", "version": "4", "evaluation": {"e": 1}}
    )
    with pytest.raises(AirflowSkipException, match="held: .*not queued"):
        op.execute(ctx)
    assert ctx["ti"].pushed["decision"]["release"]["held"] is True
    assert ctx["outlet_events"].added == [("mlflow://ctr_lora_feed/held", "held", "4")]
