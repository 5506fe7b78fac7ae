"""Registry entries serving can trust: a fresh process loads base + adapter from the registry alone and
predicts what the training process predicted (through MLflow's own load and through the trusted
`registry.pyfunc.load`); tampered adapter files and a changed base are refused by both; every version
carries its lineage and file hashes; registration is idempotent; a model card is kept. The
fresh-process load and the lineage checks also run against a real `mlflow server` over HTTP.
Tampering that also rewrites meta.json, and removed tags: test_trusted_load.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pytest
from safetensors.torch import load_file, save_file

from pipelines.config import GatePolicy, LoraTrainConfig, to_dict
from pipelines.data.lake import Lake, concat
from pipelines.errors import RegistryError
from pipelines.evaluation.compare import evaluate
from pipelines.model import adapters, features, store
from pipelines.model.inference import predict
from pipelines.promotion import gate_record
from pipelines.registry import integrity, mlflow_io, pyfunc
from pipelines.registry import register as reg
from pipelines.registry.pyfunc import load_base_from_registry
from pipelines.training import adapter
from pipelines.training.loop import LoopSettings, fit, seed_everything
from tests.pipelines.training.helpers import CFG

REPO = Path(__file__).resolve().parents[3]
END_DAY = "2024-01-05"


def _stored(tmp_path: Path, name: str) -> list[Path]:
    """Files called `name` in the local artifact store (./mlruns under the test's cwd)."""
    return sorted(p for p in tmp_path.rglob(name) if "mlruns" in p.parts)


def _fresh_process_predict(model_uri: str, rows: pd.DataFrame, tmp_path: Path, trusted: bool = False) -> np.ndarray:
    """Load `model_uri` in a new interpreter that only knows the tracking URI, and score `rows`; with
    `trusted`, through `pipelines.registry.pyfunc.load` instead of `mlflow.pyfunc.load_model`. The
    model ships no code: the interpreter imports the installed package."""
    rows.to_parquet(tmp_path / "rows.parquet")
    load = "from pipelines.registry.pyfunc import load\n" if trusted else "load = mlflow.pyfunc.load_model\n"
    script = (
        "import sys, numpy as np, pandas as pd, mlflow.pyfunc\n" + load + "m = load(sys.argv[1])\n"
        "np.save(sys.argv[3], np.asarray(m.predict(pd.read_parquet(sys.argv[2])), dtype=np.float64))\n"
    )
    env = {k: os.environ[k] for k in ("PATH", "HOME", "MLFLOW_TRACKING_URI") if k in os.environ}
    env["CTR_TORCH_THREADS"] = "1"
    out = tmp_path / "pred.npy"
    proc = subprocess.run(
        [sys.executable, "-c", script, model_uri, str(tmp_path / "rows.parquet"), str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return np.load(out)


# over HTTP too: the session's mlflow server (tests/pipelines/registry/conftest.py)
@pytest.mark.parametrize("serving_store", ["sqlite", pytest.param("http", marks=pytest.mark.slow)], indirect=True)
def test_a_fresh_process_predicts_what_the_training_process_predicted(cfg, lake, tmp_path):
    rows = concat(Lake(lake).read_window(END_DAY, 1)).head(300).reset_index(drop=True)
    seed_everything(3)
    b = mlflow_io.version_by_alias("ctr_base", "champion")

    model = adapters.attach(load_base_from_registry("ctr_base", b.version, b.tags["fingerprint"]), cfg.lora)
    train_rows = concat(Lake(lake).read_window("2024-01-04", 1))
    fit(
        model,
        (features.encode(train_rows, CFG), features.labels(train_rows)),
        LoopSettings(epochs=1, batch_size=64, lr=0.02, weight_decay=0.0, warmup_steps=2, seed=3),
    )
    in_process = predict(model, features.encode(rows, CFG)).astype(np.float64)
    base_only = predict(
        store.load_base(
            Path(mlflow.artifacts.download_artifacts(f"models:/ctr_base/{b.version}")) / "artifacts" / "base"
        ),
        features.encode(rows, CFG),
    )
    assert np.abs(in_process - base_only).max() > 1e-4  # the adapter changes predictions
    with mlflow.start_run():
        adapter_dir = tmp_path / "adapter"
        adapters.save(model, adapter_dir)
        info = mlflow_io.log_ctr_model(
            {
                "kind": "adapter",
                "slot": "feed",
                "lora": to_dict(cfg.lora),
                "base": {"name": "ctr_base", "version": str(b.version), "fingerprint": b.tags["fingerprint"]},
            },
            mlflow_io.input_example(rows),
            adapter_dir=str(adapter_dir),
        )
    version = mlflow_io.register(info.model_uri, "ctr_lora_feed", {}, run_id=info.run_id)
    fresh = _fresh_process_predict(f"models:/ctr_lora_feed/{version}", rows, tmp_path)
    np.testing.assert_allclose(fresh, in_process, rtol=0, atol=1e-6)
    # registered without tags: registration copied the logged model's record, which the trusted load checks
    trusted = _fresh_process_predict(f"models:/ctr_lora_feed/{version}", rows, tmp_path, trusted=True)
    np.testing.assert_allclose(trusted, in_process, rtol=0, atol=1e-6)


# over HTTP too: the session's mlflow server (tests/pipelines/registry/conftest.py)
@pytest.mark.parametrize("serving_store", ["sqlite", pytest.param("http", marks=pytest.mark.slow)], indirect=True)
def test_adapter_versions_carry_lineage_file_hashes_and_a_model_card(cfg, lake, tmp_path):
    cand = adapter.train(cfg, lake, END_DAY, "feed").to_dict()
    ev = evaluate(cfg, lake, cand)
    out = reg.register(cfg, cand, ev)
    mv = mlflow_io.get_version(out["model"], out["version"])
    t = mv.tags
    local = Path(mlflow.artifacts.download_artifacts(f"models:/{out['model']}/{out['version']}"))
    assert json.loads(t[integrity.TAG]) == integrity.file_hashes(local / "artifacts" / "adapter")
    assert (local / pyfunc.MODEL_FILE.name).is_file()  # models-from-code: no pickle, no code/
    assert not (local / "python_model.pkl").exists() and not (local / "code").exists()
    assert "adapter_model.safetensors" in json.loads(t[integrity.TAG])
    base = mlflow_io.version_by_alias("ctr_base", "champion")
    assert (t["base.name"], t["base.version"], t["base.fingerprint"]) == (
        "ctr_base",
        str(base.version),
        base.tags["fingerprint"],
    )
    assert t["data.sha256"] == cand["data"]["sha256"] and t["data.last"] == END_DAY
    partitions = json.loads(
        Path(mlflow.artifacts.download_artifacts(run_id=cand["run_id"], artifact_path="lineage/data.json")).read_text()
    )["partitions"]
    assert sorted(partitions) == ["2024-01-04", "2024-01-05"]
    assert partitions == {d: Lake(lake).read_partition(d).sha256 for d in partitions}  # content hashes
    assert t["config.hash"] == cand["config_hash"] and t["code.version"]
    assert json.loads(t["eval.candidate"])["auc"] == ev["candidate"]["auc"]
    assert mv.description.startswith(f"# {out['model']} v{out['version']}") and "pending" in mv.description

    lenient = GatePolicy(
        min_auc_first_run=0.5,
        max_logloss_first_run=5.0,
        calibration_min=0.01,
        calibration_max=100.0,
        max_demographic_parity_gap=1.0,
        max_equalized_odds_gap=1.0,
        latency_budget_ms=1e6,
        optional_checks=("fairness_dp", "fairness_eo"),
    )
    decision = gate_record.run(lenient, out["model"], out["version"], ev, actor="test")  # the record, not the bar
    card = mlflow_io.get_version(out["model"], out["version"]).description
    assert decision["passed"] and "**passed** (first run" in card and "auc_floor" in card
    assert f"{cand['data']['first']} .. {END_DAY}" in card
    gate_files = {a.path for a in mlflow_io.client().list_artifacts(cand["run_id"], "gate")}
    assert {f"gate/decision_v{out['version']}.json", f"gate/decision_v{out['version']}.png"} <= gate_files


def test_registration_is_idempotent_for_the_same_data_config_and_code(cfg, lake):
    cand = adapter.train(cfg, lake, END_DAY, "feed").to_dict()
    ev = evaluate(cfg, lake, cand)
    first = reg.register(cfg, cand, ev)
    again = reg.register(cfg, cand, ev)  # the task re-run
    retrained = adapter.train(cfg, lake, END_DAY, "feed").to_dict()  # the whole training re-run
    third = reg.register(cfg, retrained, evaluate(cfg, lake, retrained))
    assert first["existing"] is False and again["existing"] is True and third["existing"] is True
    assert first["version"] == again["version"] == third["version"]
    assert len(mlflow_io.client().search_model_versions("name = 'ctr_lora_feed'")) == 1

    other = adapter.train(
        cfg.__class__(**{**cfg.__dict__, "lora": LoraTrainConfig(**{**cfg.lora.__dict__, "seed": 8})}),
        lake,
        END_DAY,
        "feed",
    ).to_dict()  # another config: a new version
    assert reg.register(cfg, other, evaluate(cfg, lake, other))["version"] != first["version"]


def test_a_tampered_adapter_file_is_refused(cfg, lake, tmp_path):
    cand = adapter.train(cfg, lake, END_DAY, "feed").to_dict()
    out = reg.register(cfg, cand, evaluate(cfg, lake, cand))
    uri = f"models:/{out['model']}/{out['version']}"
    mlflow.pyfunc.load_model(uri)  # loads while intact
    stored = _stored(tmp_path, "adapter_model.safetensors")
    assert stored
    for p in stored:
        blob = bytearray(p.read_bytes())
        blob[-1] ^= 0x01  # one bit of one weight
        p.write_bytes(bytes(blob))
    with pytest.raises(RegistryError, match="adapter_model.safetensors has sha256 .* refusing to load"):
        mlflow.pyfunc.load_model(uri)  # against its meta.json
    with pytest.raises(RegistryError, match="do not match the registry .*adapter_model.safetensors has sha256"):
        pyfunc.load(uri)  # against the version's tag


def test_an_adapter_whose_base_changed_is_refused(cfg, lake, tmp_path):
    cand = adapter.train(cfg, lake, END_DAY, "feed").to_dict()
    out = reg.register(cfg, cand, evaluate(cfg, lake, cand))
    weights = _stored(tmp_path, store.WEIGHTS)  # the base's weights in the store
    assert weights

    for p in weights:
        w = load_file(str(p))
        w["head.bias"] = w["head.bias"] + 0.5  # a different base, same shapes
        save_file(w, str(p))
    for load in (mlflow.pyfunc.load_model, pyfunc.load):  # the base's own tag, both ways
        with pytest.raises(RegistryError, match="base ctr_base v1: weights hash to fingerprint .* refusing to load"):
            load(f"models:/{out['model']}/{out['version']}")
    with pytest.raises(RegistryError, match="fingerprint .* refusing to load"):
        pyfunc.load("models:/ctr_base@champion")


def test_verify_files_names_each_difference(tmp_path):
    d = tmp_path / "a"
    d.mkdir()
    (d / "w.bin").write_bytes(b"123")
    (d / "README.md").write_text("ignored")
    good = integrity.file_hashes(d)
    assert list(good) == ["w.bin"]
    integrity.verify_files(d, json.dumps(good), "m v1")
    (d / "extra.bin").write_bytes(b"x")
    with pytest.raises(RegistryError, match="extra.bin is not part of the registered adapter"):
        integrity.verify_files(d, good, "m v1")
    (d / "extra.bin").unlink()
    (d / "w.bin").unlink()
    with pytest.raises(RegistryError, match="m v1: .*w.bin is missing"):
        integrity.verify_files(d, good, "m v1")
    with pytest.raises(RegistryError, match="no recorded adapter file hashes"):
        integrity.verify_files(d, None, "m v1")
