"""The champion monitor: `monitor_day` on a real SQLite MLflow store and synthetic lakes (real adapters,
real pyfunc scoring, real alias moves). The decisions as pure functions of window records are
test_monitor_decisions.py (it shares MODEL and POLICY from here).

The world (built once per module, copied per test): a small synthetic ad world that a tiny model can
learn, a base registered as ctr_base@champion, and three `ctr_lora_feed` versions:
v1 trained up to 2024-01-04, v2 up to 2024-01-05 (a good canary / a second champion), v3 on the same
days with every label flipped (a bad canary). Degraded days keep each slot's click rate (validation
passes them) but give the clicks to the rows the serving champion ranks lowest.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import mlflow
import numpy as np
import pytest
from mlflow import MlflowClient

from pipelines.config import BaseTrainConfig, DataConfig, GatePolicy, LoraTrainConfig, PipelineConfig
from pipelines.data.lake import Lake
from pipelines.data.synthetic import SLOTS, SyntheticSpec, write_days
from pipelines.errors import ConfigError
from pipelines.flows.base import register_base
from pipelines.promotion import aliases
from pipelines.promotion.live_metrics import LiveMetricsError
from pipelines.promotion.monitor import EXPERIMENT, load_windows, monitor_day, monitor_days
from pipelines.registry import pyfunc
from pipelines.registry.model_input import predict_pctr
from pipelines.registry.register import register
from pipelines.training import adapter, base_model
from pipelines.validation.stage import validate_window
from tests.conftest import any_base_policy, use_store_copy
from tests.pipelines.training.helpers import CFG

MODEL = "ctr_lora_feed"
# Few users and items, no cold start, a higher CTR: a tiny model reaches AUC ~0.6 on a few days.
SPEC = SyntheticSpec(n_users=300, n_items=60, n_advertisers=10, new_entity_rate=0.0, slot_ctr=(0.1, 0.15, 0.05), seed=7)
ROWS = 4000
FIRST, DAYS = "2024-01-02", 7  # 2024-01-02 .. 2024-01-08
POLICY = GatePolicy(canary_healthy_windows=2, canary_auc_tolerance=0.03, revert_windows=2)


# ----------------------------------------------------------------------------- the world
def day(i: int) -> str:
    return f"2024-01-{i:02d}"


def make_config(lake: str) -> PipelineConfig:
    lora = LoraTrainConfig(r=4, alpha=8, epochs=1, batch_size=64, lr=0.02, window_days=2, min_rows=100, warmup_steps=2)
    return PipelineConfig(
        data=DataConfig(lake_uri=lake, slots=SLOTS),
        model=CFG,
        lora=lora,
        base_training=BaseTrainConfig(train_start=FIRST, epochs=2, batch_size=256),
    )


def write_lake(uri: str, flip_labels: bool = False) -> str:
    lake = Lake(uri)
    write_days(lake, SPEC, FIRST, DAYS, ROWS)
    if flip_labels:
        for d in lake.list_partitions():
            frame = lake.read_partition(d).frame
            frame["label"] = (1 - frame["label"]).astype(frame["label"].dtype)
            lake.write_partition(frame, d, overwrite=True)
    return uri


def register_adapter(cfg: PipelineConfig, lake: str, end_day: str, slot: str = "feed") -> str:
    """Train, register and mark gated (the gate itself is not what is tested here)."""
    cand = adapter.train(cfg, lake, end_day, slot).to_dict()
    reg = register(cfg, cand, {"candidate": cand["metrics"], "champion": None, "champion_version": None})
    MlflowClient().set_model_version_tag(reg["model"], reg["version"], "gate.passed", "true")
    return reg["version"]


def build_world(root: Path, template_db: Path) -> dict:
    """Base + adapters in a store under `root`; returns what tests need (paths, config)."""
    lake = write_lake(str(root / "lake"))
    flipped = write_lake(str(root / "flipped"), flip_labels=True)
    with pytest.MonkeyPatch.context() as mp:
        use_store_copy(template_db, root, mp)
        mp.setenv("CTR_CHECKPOINT_ROOT", str(root / "ckpt"))
        cfg = make_config(lake)
        for uri in (lake, flipped):  # the training days, validated as the DAGs' validate task does
            validate(make_config(uri), uri, day(5), days=4)
        register_base(cfg, base_model.train(cfg, lake, day(3)), actor="test", policy=any_base_policy())
        versions = {
            "v1": register_adapter(cfg, lake, day(4)),
            "v2": register_adapter(cfg, lake, day(5)),
            "bad": register_adapter(cfg, flipped, day(5)),
        }
        mlflow.set_tracking_uri(None)
    assert versions == {"v1": "1", "v2": "2", "bad": "3"}
    return {"db": root / "mlflow.db", "lake": lake, "cfg": cfg}


def degrade(lake_uri: str, days: list[str], model: str, version: str, slot: str = "feed") -> None:
    """Keep the slot's clicks per day but give them to the rows `model` v`version` ranks lowest."""
    lake = Lake(lake_uri)
    m = pyfunc.load(f"models:/{model}/{version}")
    for d in days:
        frame = lake.read_partition(d).frame
        rows = frame.index[frame["slot"] == slot]
        p = predict_pctr(m, frame.loc[rows])
        clicks = int(frame.loc[rows, "label"].sum())
        label = np.zeros(len(rows), dtype=frame["label"].dtype)
        label[np.argsort(p, kind="stable")[:clicks]] = 1
        frame.loc[rows, "label"] = label
        lake.write_partition(frame, d, overwrite=True)


def validate(cfg: PipelineConfig, lake: str, d: str, days: int = 1) -> None:
    assert validate_window(cfg, lake, d, days)["success"]


@pytest.fixture(scope="module")
def world(tmp_path_factory, template_db):
    return build_world(tmp_path_factory.mktemp("monitor-world"), template_db)


@pytest.fixture
def store(world, tmp_path, monkeypatch):
    """A fresh copy of the world's store and its own copy of the lake (tests write markers and labels)."""
    use_store_copy(world["db"], tmp_path, monkeypatch)
    lake = str(tmp_path / "lake")
    shutil.copytree(world["lake"], lake)
    yield {**world, "lake": lake, "cfg": replace(world["cfg"], data=replace(world["cfg"].data, lake_uri=lake))}
    mlflow.set_tracking_uri(None)


def start(model: str, champion: str, canary: str | None = None) -> None:
    aliases.move_alias(model, "champion", champion, kind="promote", reason="test: serving", actor="test")
    if canary:
        aliases.start_canary(model, canary, 0.1, reason="test: canary", actor="test")


def feed(result: dict) -> dict:
    (out,) = [m for m in result["models"] if m["model"] == MODEL]
    return out


def monitor_runs() -> int:
    exp = mlflow.get_experiment_by_name(EXPERIMENT)
    return 0 if exp is None else len(MlflowClient().search_runs([exp.experiment_id]))


# ----------------------------------------------------------------------------- monitor_day on a store
def test_healthy_canary_is_promoted_after_n_windows_and_reruns_move_nothing(store):
    cfg, lake = store["cfg"], store["lake"]
    start(MODEL, "1", canary="2")
    for i in (5, 6, 7):
        validate(cfg, lake, day(i))

    r5 = feed(monitor_day(cfg, POLICY, lake, day(5)))  # v2 was trained on dt=2024-01-05
    assert "in-sample" in r5["skipped"]["canary"] and r5["windows"]["champion"]["version"] == "1"
    assert r5["canary_decision"]["action"] == "wait" and r5["moves"] == []

    r6 = feed(monitor_day(cfg, POLICY, lake, day(6)))
    assert r6["canary_decision"]["action"] == "wait" and "1/2 healthy" in r6["canary_decision"]["reason"]
    ch, ca = r6["windows"]["champion"]["auc"], r6["windows"]["canary"]["auc"]
    assert ca >= ch - POLICY.canary_auc_tolerance and ch > 0.55

    full = monitor_day(cfg, POLICY, lake, day(7))
    r7 = feed(full)
    assert r7["canary_decision"]["action"] == "promote" and r7["revert_decision"]["action"] == "keep"
    assert aliases.current(MODEL) == "2" and aliases.current(MODEL, "canary") is None
    promote = aliases.history(MODEL)[-1]
    assert (promote["kind"], promote["from_version"], promote["to_version"]) == ("promote", "1", "2")
    assert "dt=2024-01-06" in promote["reason"] and "dt=2024-01-07" in promote["reason"]
    assert promote["op_id"] == f"monitor/{MODEL}/{day(7)}/promote-canary/v2"
    # every monitored model is in the result, the ones without a champion as skips
    others = {m["model"]: m["skipped"] for m in full["models"] if m["model"] != MODEL}
    assert set(others) == {"ctr_lora_search", "ctr_lora_splash", "ctr_lora_cold_start"}
    assert all("has no @champion" in s["model"] for s in others.values())
    assert full["errors"] == [] and full["reverts"] == []
    assert json.loads(json.dumps(full)) == full  # JSON-safe: what XCom and the CLI carry

    # the same day again: the windows are found, nothing is scored, recorded or moved twice
    runs, moves = monitor_runs(), len(aliases.history(MODEL, None))
    again = feed(monitor_day(cfg, POLICY, lake, day(7)))
    assert monitor_runs() == runs and len(aliases.history(MODEL, None)) == moves
    assert again["windows"]["champion"]["how"] == "recorded earlier as canary"  # v2, promoted today
    assert runs == 5  # 5: champion; 6, 7: champion + canary
    recorded = load_windows(MODEL)
    assert [(x.alias, x.version, x.day) for x in recorded][-2:] == [("champion", "1", day(7)), ("canary", "2", day(7))]
    assert recorded[-1].champion_version == "1" and recorded[-1].metrics["rows"] > 1000


def test_bad_canary_is_withdrawn_with_the_numbers(store):
    cfg, lake = store["cfg"], store["lake"]
    start(MODEL, "1", canary="3")
    validate(cfg, lake, day(6))
    r = feed(monitor_day(cfg, POLICY, lake, day(6)))
    ch, ca = r["windows"]["champion"]["auc"], r["windows"]["canary"]["auc"]
    assert ca < ch - POLICY.canary_auc_tolerance
    assert r["canary_decision"]["action"] == "withdraw"
    assert aliases.current(MODEL, "canary") is None and aliases.current(MODEL) == "1"
    entry = aliases.history(MODEL, "canary")[-1]
    assert entry["kind"] == "withdraw" and f"{ca:.4f} < champion v1 AUC {ch:.4f}" in entry["reason"]
    n = len(aliases.history(MODEL, None))
    monitor_day(cfg, POLICY, lake, day(6))
    assert len(aliases.history(MODEL, None)) == n


def test_degrading_champion_is_reverted_after_k_windows(store):
    cfg, lake = store["cfg"], store["lake"]
    start(MODEL, "1")
    start(MODEL, "2")  # history: v1 then v2, so a revert has a target
    degrade(lake, [day(7), day(8)], MODEL, "2")
    for i in (6, 7, 8):
        validate(cfg, lake, day(i))
    r6 = feed(monitor_day(cfg, POLICY, lake, day(6)))
    assert r6["revert_decision"]["action"] == "keep" and r6["reference"]["source"].startswith("eval.candidate")
    r7 = monitor_day(cfg, POLICY, lake, day(7))
    assert feed(r7)["revert_decision"]["action"] == "keep" and "1/2 windows" in feed(r7)["revert_decision"]["reason"]
    assert r7["reverts"] == []
    r8 = monitor_day(cfg, POLICY, lake, day(8))
    (due,) = r8["reverts"]
    assert due["model"] == MODEL and due["to_version"] == "1" and set(due) == {"model", "to_version", "reason"}
    assert "dt=2024-01-07" in due["reason"] and "dt=2024-01-08" in due["reason"]
    assert aliases.current(MODEL) == "2", "the DAG path leaves the move to the revert operator"

    applied = monitor_day(cfg, POLICY, lake, day(8), apply_reverts=True)  # the CLI path
    assert applied["applied_reverts"][0]["moved"] is True and aliases.current(MODEL) == "1"
    entry = aliases.history(MODEL)[-1]
    assert entry["kind"] == "revert" and entry["reason"] == due["reason"] and entry["actor"] == "ctr_champion_monitor"
    again = monitor_day(cfg, POLICY, lake, day(8), apply_reverts=True)
    assert again["reverts"] == [] and aliases.current(MODEL) == "1"  # v1 has no bad streak of its own


def test_several_days_in_one_run_are_one_window_each(store):
    """A run that consumed several validated days (the DAG during a backfill of ctr_lake_arrival)
    decides as if each day had had a run of its own: the bad streak spans them, the revert is due once."""
    cfg, lake = store["cfg"], store["lake"]
    start(MODEL, "1")
    start(MODEL, "2")
    degrade(lake, [day(7), day(8)], MODEL, "2")
    for i in (6, 7, 8):
        validate(cfg, lake, day(i))
    result = monitor_days(cfg, POLICY, lake, [day(8), day(6), day(7), day(8)])
    assert result["days"] == [day(6), day(7), day(8)]
    entries = [m for m in result["models"] if m["model"] == MODEL]
    assert [m["revert_decision"]["action"] for m in entries] == ["keep", "keep", "revert"]
    (due,) = result["reverts"]
    assert due["to_version"] == "1" and "dt=2024-01-07" in due["reason"] and "dt=2024-01-08" in due["reason"]
    assert monitor_runs() == 3 and aliases.current(MODEL) == "2"  # three windows; the operator moves
    assert monitor_days(cfg, POLICY, lake, [day(8)])["day"] == day(8)  # one day: monitor_day's own result


def test_unvalidated_or_quarantined_days_are_skipped_without_records(store):
    cfg, lake = store["cfg"], store["lake"]
    start(MODEL, "1")
    r = monitor_day(cfg, POLICY, lake, day(6))
    assert "no validation marker" in r["skipped"] and r["models"] == [] and monitor_runs() == 0
    validate(cfg, lake, day(6))
    marker = Path(lake) / f"dt={day(6)}" / "_validation.json"
    m = json.loads(marker.read_text())
    marker.write_text(json.dumps({**m, "status": "quarantined"}))
    assert "'quarantined' by validation" in monitor_day(cfg, POLICY, lake, day(6))["skipped"]
    marker.write_text(json.dumps({**m, "sha256": "0" * 64}))
    assert "changed since it was validated" in monitor_day(cfg, POLICY, lake, day(6))["skipped"]
    assert monitor_runs() == 0


class CannedLive:
    """A live-metrics source with fixed answers; `None` entries raise like an unreachable Prometheus."""

    def __init__(self, answers: dict):
        self.answers = answers

    def window_metrics(self, model, version, day):
        got = self.answers[(version, day)]
        if got is None:
            raise LiveMetricsError("http://127.0.0.1:1", "ctr", "unreachable")
        return got


def test_live_metrics_are_merged_and_a_failing_source_is_no_data(store, caplog):
    cfg, lake = store["cfg"], store["lake"]
    start(MODEL, "1")
    policy = replace(POLICY, revert_metric="ctr", revert_windows=1)
    with pytest.raises(ConfigError, match="revert_metric is 'ctr'"):
        monitor_day(cfg, policy, lake, day(6))
    for i in (6, 7):
        validate(cfg, lake, day(i))
    live = CannedLive({("1", day(6)): {"ctr": 0.12}, ("1", day(7)): None})
    r6 = feed(monitor_day(cfg, policy, lake, day(6), live=live))
    assert r6["windows"]["champion"]["live_ctr"] == 0.12 and r6["reference"]["value"] == 0.12
    r7 = feed(monitor_day(cfg, policy, lake, day(7), live=live))
    assert "live_ctr" not in r7["windows"]["champion"] and r7["revert_decision"]["action"] == "keep"
    assert "no live metrics for ctr_lora_feed v1 dt=2024-01-07: LiveMetricsError" in caplog.text
