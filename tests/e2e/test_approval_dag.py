"""`approval: true` through a real `airflow dags test ctr_lora_retrain` run: every candidate waits in
Airflow's human-in-the-loop step until a person answers, and each answer releases (or not) only its
own candidate. The answers go through the Core API's HITL handler from another process
(tests/e2e/hitl_respond.py), as from the UI.

Set-up in-process: a synthetic lake in moto's S3 with three slots and the serving base; no adapter
has a champion yet, so a released candidate becomes @champion (`promotion: direct` here).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import sqlalchemy as sa
from mlflow import MlflowClient

from pipelines.config import GatePolicy
from pipelines.promotion.aliases import current, history
from tests.e2e.stack import REPO, Stack, synthetic_stack

pytestmark = pytest.mark.slow

BUCKET = "e2e-approval-lake"
DAY = "2024-01-05"
# A permissive gate: what is tested is the human step after it, so every candidate must pass (fairness
# per group is optional, as in the shipped policy: the small synthetic holdouts may not measure it).
POLICY = replace(
    GatePolicy(),
    approval=True,
    promotion="direct",
    min_auc_first_run=0.5,
    max_logloss_first_run=5.0,
    max_demographic_parity_gap=1.0,
    max_equalized_odds_gap=1.0,
    calibration_min=0.01,
    calibration_max=100.0,
    latency_budget_ms=60_000.0,
    optional_checks=("fairness_dp", "fairness_eo"),
)
ANSWERS = {"ctr_lora_feed": "Approve", "ctr_lora_search": "Approve", "ctr_lora_splash": "Reject"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, s3_endpoint):
    with synthetic_stack(tmp_path_factory.mktemp("e2e-approval"), BUCKET, POLICY) as (st, _, _):
        yield st


def airflow_rows(stack: Stack, sql: str, **params) -> list:
    engine = sa.create_engine(stack.env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"])
    with engine.connect() as conn:
        rows = conn.execute(sa.text(sql), params).all()
    engine.dispose()
    return rows


def task_states(stack: Stack, dag_id: str) -> dict[tuple[str, int], str]:
    rows = airflow_rows(stack, "SELECT task_id, map_index, state FROM task_instance WHERE dag_id = :d", d=dag_id)
    return {(t, m): s for t, m, s in rows}


def test_each_release_waits_for_its_own_approval(stack):
    log_path = stack.tmp / "dags_test.log"
    with open(log_path, "w") as log:
        run = subprocess.Popen(
            [str(Path(sys.executable).with_name("airflow")), "dags", "test", "ctr_lora_retrain", DAY],
            env=stack.env,
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            responder = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "tests.e2e.hitl_respond",
                    "--dag",
                    "ctr_lora_retrain",
                    "--answers",
                    json.dumps(ANSWERS),
                    "--timeout",
                    "900",
                ],
                env=stack.env,
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=960,
            )
            rc = run.wait(timeout=600)
        finally:
            if run.poll() is None:
                run.kill()
    out = log_path.read_text()
    assert responder.returncode == 0, responder.stderr[-3000:] + out[-4000:]
    assert rc == 0, out[-6000:]
    assert "Waiting for Human-in-the-loop input" in out  # the run really parked until the answers came

    for name in ("ctr_lora_feed", "ctr_lora_search"):
        assert current(name) == "1", name
        (move,) = history(name)
        assert move["kind"] == "promote" and move["to_version"] == "1"
        assert move["reason"] == "passed gate (first run) (approved by release-manager)"
        assert "airflow:ctr_lora_retrain/" in move["actor"] and "/approval.release[" in move["op_id"]
    # Rejected by the person, not by the gate: the version passed its gate and still does not serve.
    (splash,) = MlflowClient().search_model_versions("name = 'ctr_lora_splash'")
    assert splash.tags["gate.passed"] == "true"
    assert current("ctr_lora_splash") is None and history("ctr_lora_splash") == []
    for v, answer in ((splash, "Reject"), (MlflowClient().get_model_version("ctr_lora_feed", "1"), "Approve")):
        record = json.loads(v.tags["release.approval"])
        assert (record["answer"], record["by"]) == (answer, "release-manager") and record["at"]

    # The rule lives in the library, not in the DAG's shape: the rejected version cannot be promoted by
    # hand; the approved ones record that their gate asked for the approval.
    assert splash.tags["gate.approval_required"] == "true"
    refused = stack.pipelines("promote", "--model", "ctr_lora_splash", "--version", "1", "--reason", "e2e: by hand")
    assert refused.returncode == 1 and "v1 was rejected by release-manager" in refused.stderr, refused.stderr
    assert current("ctr_lora_splash") is None

    states = task_states(stack, "ctr_lora_retrain")
    releases = {m: s for (t, m), s in states.items() if t == "approval.release"}
    approvals = {m: s for (t, m), s in states.items() if t == "approval.approve_release"}
    assert sorted(releases.values()) == ["skipped", "success", "success"], states
    assert set(approvals.values()) == {"success"}, states

    # names, not numbers: each mapped instance is named by its slot or model, each approval asks about one version
    labels = airflow_rows(
        stack,
        "SELECT task_id, rendered_map_index FROM task_instance WHERE dag_id = :d AND map_index >= 0",
        d="ctr_lora_retrain",
    )
    named = {t: sorted(label for task, label in labels if task == t) for t, _ in labels}
    assert named["train_adapter"] == named["evaluate"] == named["register"] == ["feed", "search", "splash"], named
    assert named["approval.approve_release"] == ["ctr_lora_feed", "ctr_lora_search", "ctr_lora_splash"], named
    subjects = sorted(r[0] for r in airflow_rows(stack, "SELECT subject FROM hitl_detail"))
    assert subjects == [
        f"CTR adapter: release ctr_lora_{slot} v1 (its first version)?" for slot in ("feed", "search", "splash")
    ], subjects
