"""Real runs of `ctr_model_ops` (`airflow dags test`, PostgreSQL metadata stores when reachable, else
SQLite) against a registry set up in-process (issue 13): the form's reason `12345` is recorded as
text instead of crashing the task, a 2,000-character reason is refused before any task runs, and a
promote is refused for a version a person rejected, or without the approval the policy asks for;
the override of the rejection goes out and records it."""

from __future__ import annotations

import json

import pytest
import yaml

from pipelines.promotion import aliases, release
from pipelines.registry import mlflow_io
from tests.e2e.stack import REPO, Stack, make_env, metadata_stores, this_process_on
from tests.pipelines.promotion.test_aliases import add_version

pytestmark = pytest.mark.slow

MODEL = "ctr_lora_feed"
FP = "f" * 64


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("model-ops")
    policy = tmp / "gate_policy.yaml"
    policy.write_text(yaml.safe_dump({"approval": False}))
    with metadata_stores(tmp) as (airflow_conn, mlflow_uri, kind):
        env = make_env(tmp, airflow_conn, mlflow_uri, REPO / "configs" / "pipeline.yaml", str(tmp / "artifacts"))
        st = Stack({**env, "CTR_GATE_POLICY": str(policy)}, kind, tmp)
        st.init_airflow()
        with this_process_on(mlflow_uri):
            base = add_version("ctr_base", gate_passed=None, fingerprint=FP)
            mlflow_io.client().set_registered_model_alias("ctr_base", "champion", base)
            for _ in range(3):  # v1, v2, v3: passed their gate (as first runs) on the serving base
                add_version(MODEL, base__fingerprint=FP, gate__champion_version="")
            release.record_approval(
                MODEL,
                "2",
                answer="Reject",
                by="bob",
                at="2024-01-05T10:00:00+00:00",
                task="airflow:ctr_lora_retrain/r/approval.release[0]",
            )
            yield st, policy


def model_ops(st: Stack, **conf) -> tuple[int, str]:
    proc = st.airflow("dags", "test", "ctr_model_ops", "-c", json.dumps({"model": MODEL, **conf}), check=False)
    return proc.returncode, proc.stdout + proc.stderr


def test_a_numeric_reason_is_recorded_as_text(stack):
    st, _ = stack
    rc, out = model_ops(st, action="promote", version=1, reason="12345")
    assert rc == 0, out[-4000:]
    assert aliases.current(MODEL) == "1" and aliases.history(MODEL)[-1]["reason"] == "12345"


def test_a_reason_of_2000_characters_is_refused_before_any_task(stack):
    st, _ = stack
    n = len(aliases.history(MODEL, None))
    rc, out = model_ops(st, action="revert", reason="x" * 2000)
    assert rc != 0 and "ParamValidationError" in out and "is too long" in out, out[-3000:]
    assert len(aliases.history(MODEL, None)) == n


def test_a_rejected_version_is_refused_by_promote_and_goes_out_by_override(stack):
    st, _ = stack
    before = aliases.current(MODEL)
    rc, out = model_ops(st, action="promote", version=2, reason="bob was wrong")
    assert rc != 0 and "v2 was rejected by bob" in out, out[-4000:]
    assert aliases.current(MODEL) == before

    rc, out = model_ops(st, action="override", version=2, reason="bob's concern is fixed upstream")
    assert rc == 0, out[-4000:]
    assert aliases.current(MODEL) == "2" and aliases.history(MODEL)[-1]["kind"] == "override"
    record = json.loads(mlflow_io.get_version(MODEL, "2").tags["gate.override"])
    assert record["rejection"]["by"] == "bob" and "ctr_model_ops" in aliases.history(MODEL)[-1]["actor"]


def test_a_promote_is_refused_without_the_approval_the_policy_asks_for(stack):
    st, policy = stack
    before = aliases.current(MODEL)
    policy.write_text(yaml.safe_dump({"approval": True}))  # read by the task when it runs
    try:
        rc, out = model_ops(st, action="promote", version=3, reason="release v3 by hand")
    finally:
        policy.write_text(yaml.safe_dump({"approval": False}))
    assert rc != 0 and "v3 needs a recorded approval" in out, out[-4000:]
    assert aliases.current(MODEL) == before
