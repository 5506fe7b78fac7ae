"""End to end through real Airflow DAG runs (`airflow dags test`): base model, two daily retrains
(the second gated against the first's champion), revert, and a bad partition that must stop the
run at validation without touching the registry."""

from __future__ import annotations

import io
import json

import boto3
import mlflow
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sqlalchemy as sa
from mlflow import MlflowClient

from pipelines.data import movielens
from pipelines.data.commit import PartitionWriter
from pipelines.data.lake import Lake
from pipelines.promotion import aliases
from tests.e2e.stack import CANARY, HOLDOUT_JUDGED, movielens_stack

pytestmark = pytest.mark.slow

DAY1, DAY2, BAD_DAY = "1998-03-01", "1998-03-02", "1998-03-03"
SLOTS = ("morning", "afternoon", "night")
LINEAGE_TAGS = (
    "data.first",
    "data.last",
    "data.partitions",
    "data.sha256",
    "config.hash",
    "code.version",
    "base.name",
    "base.version",
    "base.fingerprint",
    "training.run_id",
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, s3_endpoint):
    with movielens_stack(tmp_path_factory.mktemp("e2e"), "e2e-lake", DAY2, paths=CANARY, **HOLDOUT_JUDGED) as st:
        yield st


def versions(name: str) -> list:
    return sorted(MlflowClient().search_model_versions(f"name = '{name}'"), key=lambda v: int(v.version))


def champion(name: str) -> str | None:
    return current(name)


def current(name: str, alias: str = "champion") -> str | None:
    return aliases.current(name, alias)


def history(name: str, alias: str = "champion") -> list[dict]:
    return aliases.history(name, alias)


def asset_events(stack, uri: str) -> int:
    """Asset events Airflow recorded for `uri` (the alias moves that deployment DAGs can react to)."""
    engine = sa.create_engine(stack.env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"])
    with engine.connect() as conn:
        n = conn.execute(
            sa.text("SELECT count(*) FROM asset_event e JOIN asset a ON a.id = e.asset_id WHERE a.uri = :uri"),
            {"uri": uri},
        ).scalar()
    engine.dispose()
    return int(n)


def test_base_model_dag_registers_the_serving_base(stack):
    stack.airflow("dags", "test", "ctr_base_model", "1997-12-31")
    (v1,) = versions("ctr_base")
    assert champion("ctr_base") == "1"
    assert len(v1.tags["fingerprint"]) == 64
    assert v1.tags["data.first"] == "1997-11-01" and v1.tags["data.last"] == "1997-12-31"
    # a release: gated (the first base: the policy's floor and ceiling, calibration) and recorded
    assert v1.tags["gate.passed"] == "true" and v1.tags["gate.first_run"] == "true", v1.tags.get("gate.checks")
    assert history("ctr_base")[-1]["reason"] == (
        "base passed gate (first base); adapters this base makes incompatible (retrain them): none"
    )


def test_retrain_two_days_gates_against_the_previous_champion(stack):
    stack.airflow("dags", "test", "ctr_lora_retrain", DAY1)
    for slot in SLOTS:
        (v1,) = versions(f"ctr_lora_{slot}")
        assert v1.tags["gate.passed"] == "true", v1.tags.get("gate.checks")
        assert v1.tags["gate.first_run"] == "true" and champion(f"ctr_lora_{slot}") == "1"

    proc = stack.airflow("dags", "test", "ctr_lora_retrain", DAY2)
    out = proc.stdout + proc.stderr
    assert "7 partitions ending" in out and f"dt={DAY2}/_validation_report.html" in out
    base = versions("ctr_base")[0]
    for slot in SLOTS:
        name = f"ctr_lora_{slot}"
        v1, v2 = versions(name)
        for tag in LINEAGE_TAGS:
            assert v2.tags.get(tag), f"{name} v2 lacks lineage tag {tag}"
        assert v2.tags["base.fingerprint"] == base.tags["fingerprint"] and v2.tags["base.version"] == "1"
        assert v2.tags["data.last"] == DAY2 and v1.tags["data.last"] == DAY1
        assert v1.tags["data.sha256"] != v2.tags["data.sha256"]
        # Gated against the serving champion (v1), on the same rows, and the alias follows the decision.
        assert v2.tags["eval.champion_version"] == "1"
        assert json.loads(v2.tags["eval.champion"])["rows"] == json.loads(v2.tags["eval.candidate"])["rows"]
        assert v2.tags["gate.first_run"] == "false"
        assert v2.description.startswith(f"# {name} v2") and "## Gate" in v2.description  # the model card
        passed = v2.tags["gate.passed"] == "true"
        # promotion: canary (the shipped policy's; tests/e2e/stack.py: paths_policy): a passing day-2 candidate
        # takes a share of the users next to the day-1 champion; the champion itself does not move.
        assert champion(name) == "1" and current(name, "canary") == ("2" if passed else None)
        kinds = [(h["kind"], h["from_version"], h["to_version"]) for h in history(name)]
        assert kinds == [("promote", "", "1")]
        assert [(h["kind"], h["to_version"]) for h in history(name, "canary")] == ([("canary", "2")] if passed else [])
    assert "gate PASSED" in out and "fairness_dp[age_bucket]" in out and "latency_p99_batch32_ms" in out


def test_canary_promotion_and_revert_from_the_ui(stack):
    moved = [f"ctr_lora_{s}" for s in SLOTS if current(f"ctr_lora_{s}", "canary") == "2"]
    assert moved, "no candidate passed the gate on day 2; the canary and revert paths would be untested"
    for name in moved:
        conf = json.dumps({"action": "promote_canary", "model": name, "reason": "e2e: canary looks healthy"})
        stack.airflow("dags", "test", "ctr_model_ops", "-c", conf)
        assert champion(name) == "2" and current(name, "canary") is None
        assert asset_events(stack, f"mlflow://{name}/champion") >= 1
        conf = json.dumps({"action": "revert", "model": name, "reason": "e2e: revert to day 1"})
        stack.airflow("dags", "test", "ctr_model_ops", "-c", conf)
        assert champion(name) == "1"
        entries = history(name)
        assert [(h["kind"], h["from_version"], h["to_version"]) for h in entries] == [
            ("promote", "", "1"),
            ("promote", "1", "2"),
            ("revert", "2", "1"),
        ]
        assert entries[-1]["reason"] == "e2e: revert to day 1" and "ctr_model_ops" in entries[-1]["actor"]
        # The same history through the CLI, as JSON lines.
        out = stack.pipelines("history", "--model", name)
        assert out.returncode == 0, out.stderr
        assert [json.loads(line)["kind"] for line in out.stdout.splitlines()] == ["promote", "promote", "revert"]

    # A second revert has no earlier champion to go to: refused, alias and history untouched.
    name = moved[0]
    conf = json.dumps({"action": "revert", "model": name, "reason": "e2e: one revert too many"})
    proc = stack.airflow("dags", "test", "ctr_model_ops", "-c", conf, check=False)
    assert proc.returncode != 0
    assert "no earlier champion" in proc.stdout + proc.stderr
    assert champion(name) == "1" and len(history(name)) == 3


def test_bad_partition_stops_the_run_at_validation(stack):
    frame = next(p for d, p in movielens.daily_partitions() if d == BAD_DAY).drop(columns=["slot"])
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), buf)
    s3 = boto3.client("s3")
    # committed like any partition (the contract is broken, not the commit): validation must catch it
    writer = PartitionWriter(Lake("s3://e2e-lake/clicks"), BAD_DAY)
    key = "clicks/" + writer.put_part(buf.getvalue()).split("/clicks/", 1)[1]
    writer.commit()

    before = {s: (len(versions(f"ctr_lora_{s}")), champion(f"ctr_lora_{s}")) for s in SLOTS}
    proc = stack.airflow("dags", "test", "ctr_lora_retrain", BAD_DAY, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert f"FAILED expect_column_to_exist(slot) @ dt={BAD_DAY}" in out
    assert "DataValidationError" in out
    # deterministic: failed at once, never retried (ctr_task: TaskRefused is Airflow's fail-without-retry)
    assert "TaskRefused: DataValidationError" in out and "up_for_retry" not in out.lower()
    after = {s: (len(versions(f"ctr_lora_{s}")), champion(f"ctr_lora_{s}")) for s in SLOTS}
    assert after == before, "a failed validation must register nothing and leave @champion untouched"

    trained = mlflow.search_runs(experiment_names=["ctr-lora"], filter_string=f"tags.`data.end` = '{BAD_DAY}'")
    assert len(trained) == 0, "no adapter may train on a window with an invalid partition"

    # Quarantined, not deleted or rewritten; the report sits next to the partition and in MLflow.
    assert s3.get_object(Bucket="e2e-lake", Key=key)["Body"].read() == buf.getvalue()
    marker = json.loads(s3.get_object(Bucket="e2e-lake", Key=f"clicks/dt={BAD_DAY}/_validation.json")["Body"].read())
    assert marker["status"] == "quarantined"
    assert any(f["check"] == "expect_column_to_exist(slot)" for f in marker["report"]["failures"])
    html = s3.get_object(Bucket="e2e-lake", Key=f"clicks/dt={BAD_DAY}/_validation_report.html")["Body"].read().decode()
    assert "FAILED" in html and "expect_column_to_exist(slot)" in html
    runs = mlflow.search_runs(
        experiment_names=["ctr-data-validation"], filter_string=f"tags.end_day = '{BAD_DAY}'", output_format="list"
    )
    assert len(runs) == 1 and runs[0].data.tags["success"] == "False"
    arts = {a.path for a in mlflow.MlflowClient().list_artifacts(runs[0].info.run_id, f"reports/dt={BAD_DAY}")}
    assert f"reports/dt={BAD_DAY}/validation_report.html" in arts
