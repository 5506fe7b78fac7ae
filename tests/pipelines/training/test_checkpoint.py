"""Checkpoints: round trip (local and S3), atomic writes, RNG states, resume == uninterrupted, SIGKILL."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pipelines.config import REPO_ROOT, LoraTrainConfig
from pipelines.training import checkpoint as ck
from pipelines.model import adapters
from pipelines.training.checkpoint import CheckpointStore
from pipelines.training.loop import LoopSettings, fit, seed_everything
from tests.pipelines.training.helpers import base, rows

LCFG = LoraTrainConfig(
    r=4, alpha=8, dropout=0.1, target_modules=("q_proj", "v_proj", "embeddings"), train_layernorm_bias=True
)


def settings(epochs=4, patience=4, seed=7) -> LoopSettings:
    return LoopSettings(
        epochs=epochs, batch_size=64, lr=5e-3, weight_decay=0.01, warmup_steps=3, seed=seed, patience=patience
    )


@pytest.fixture(scope="module")
def data():
    return rows("2024-01-03", 640), rows("2024-01-04", 200)


def fresh():
    seed_everything(7)
    return adapters.attach(base(), LCFG)


def weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def strip_speed(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in h.items() if k != "samples_per_s"} for h in history]


# ----------------------------------------------------------------------------- the store
def test_store_round_trip_is_atomic_and_ignores_a_corrupt_file(tmp_path, caplog):
    store = CheckpointStore(str(tmp_path / "run"))
    assert store.load() is None
    gen = torch.Generator().manual_seed(3)
    state = {
        "epoch": 2,
        "weights": {"a": torch.arange(6.0).reshape(2, 3)},
        "history": [{"epoch": 1, "x": 0.5}],
        "best": None,
        "rng": ck.capture_rng(gen),
        "key": {"settings": {"lr": 0.1}},
    }
    assert store.save(state) == str(tmp_path / "run" / ck.FILENAME)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [ck.FILENAME]  # no temp file left
    got = store.load()
    assert got["epoch"] == 2 and got["history"] == state["history"] and got["key"] == state["key"]
    assert torch.equal(got["weights"]["a"], state["weights"]["a"])

    (tmp_path / "run" / ck.FILENAME).write_bytes(b"truncated")
    with caplog.at_level(logging.WARNING):
        assert store.load() is None
    assert "unreadable checkpoint" in caplog.text
    store.delete()
    assert not (tmp_path / "run" / ck.FILENAME).exists()
    store.delete()  # idempotent


def test_store_round_trip_on_s3(s3_bucket):
    store = CheckpointStore(f"s3://{s3_bucket}/_checkpoints/ctr_lora_feed/2024-01-03/abc")
    assert store.load() is None
    store.save({"epoch": 1, "weights": {"w": torch.ones(3)}})
    got = store.load()
    assert got["epoch"] == 1 and torch.equal(got["weights"]["w"], torch.ones(3))
    store.delete()
    assert store.load() is None


def test_rng_states_restore_exactly():
    def draw(g):
        return torch.randperm(50, generator=g), torch.rand(5), np.random.rand(5), [random.random() for _ in range(5)]

    gen = torch.Generator().manual_seed(11)
    draw(gen)
    saved = ck.deserialize(ck.serialize(ck.capture_rng(gen)))  # through the file format, weights_only
    first = draw(gen)
    other = torch.Generator()
    ck.restore_rng(saved, other)
    second = draw(other)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    np.testing.assert_array_equal(first[2], second[2])
    assert first[3] == second[3]


def test_default_location_is_deterministic_and_configurable(monkeypatch):
    monkeypatch.delenv(ck.ROOT_ENV, raising=False)
    root = ck.default_root("s3://ctr-lake/clicks/")
    assert root == "s3://ctr-lake/clicks/_checkpoints"
    uri = ck.default_uri(root, "ctr_lora_night", "1998-03-01", "f" * 64)
    assert uri == ck.default_uri(root, "ctr_lora_night", "1998-03-01", "f" * 64)
    assert uri == "s3://ctr-lake/clicks/_checkpoints/ctr_lora_night/1998-03-01/" + "f" * 16
    monkeypatch.setenv(ck.ROOT_ENV, "/var/ckpt")
    assert ck.default_root("s3://ctr-lake/clicks") == "/var/ckpt"


# ----------------------------------------------------------------------------- resume in process
class Crash(Exception):
    pass


def crash_after(epoch: int):
    def on_epoch(m):
        if m["epoch"] == epoch:
            raise Crash

    return on_epoch


def test_resume_reaches_the_weights_of_an_uninterrupted_run(data, tmp_path):
    (x, y), val = data
    ref_model = fresh()
    ref = fit(ref_model, (x, y), settings(), val=val)

    store = CheckpointStore(str(tmp_path / "ck"))
    with pytest.raises(Crash):
        fit(fresh(), (x, y), settings(), val=val, checkpoint=store, on_epoch=crash_after(2))
    seen = []
    model = fresh()
    res = fit(model, (x, y), settings(), val=val, checkpoint=store, on_epoch=seen.append)
    assert res["resumed_from_epoch"] == 2
    assert_same(weights(model), weights(ref_model))
    assert strip_speed(res["history"]) == strip_speed(ref["history"])
    assert [m["epoch"] for m in seen] == [1, 2, 3, 4]  # restored epochs are re-reported, then the new ones
    assert res["best_epoch"] == ref["best_epoch"]

    # a finished checkpoint resumes to the same final weights without training again
    again = fresh()
    res2 = fit(again, (x, y), settings(), val=val, checkpoint=store)
    assert res2["resumed_from_epoch"] == 4 and res2["epochs_run"] == 4
    assert_same(weights(again), weights(ref_model))


def test_a_checkpoint_of_another_run_is_not_resumed(data, tmp_path, caplog):
    (x, y), val = data
    store = CheckpointStore(str(tmp_path / "ck"))
    fit(fresh(), (x, y), settings(epochs=1), val=val, checkpoint=store)
    with caplog.at_level(logging.WARNING):
        res = fit(fresh(), (x, y), settings(epochs=2), val=val, checkpoint=store, run_key={"data": "other"})
    assert res["resumed_from_epoch"] is None and res["epochs_run"] == 2
    assert "belongs to another run" in caplog.text


class FailingStore(CheckpointStore):
    def save(self, state):
        raise OSError("disk full")


def test_a_failing_checkpoint_write_does_not_fail_training(data, tmp_path, caplog):
    (x, y), val = data
    ref_model = fresh()
    fit(ref_model, (x, y), settings(epochs=2), val=val)
    model = fresh()
    with caplog.at_level(logging.WARNING):
        res = fit(model, (x, y), settings(epochs=2), val=val, checkpoint=FailingStore(str(tmp_path / "ck")))
    assert res["epochs_run"] == 2 and "could not write checkpoint" in caplog.text
    assert_same(weights(model), weights(ref_model))


# ----------------------------------------------------------------------------- a real kill
def _helper(ckpt: Path, out: Path, epochs: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "CTR_TORCH_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.pipelines.training.resume_helper", str(ckpt), str(out), str(epochs)],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def test_sigkilled_training_resumes_to_identical_weights(tmp_path):
    epochs = 6
    ref = _helper(tmp_path / "ref_ck", tmp_path / "ref", epochs)  # uninterrupted, in parallel
    victim = _helper(tmp_path / "ck", tmp_path / "run", epochs)
    marker, deadline = tmp_path / "ck" / ck.FILENAME, time.monotonic() + 120
    while not marker.exists():
        assert victim.poll() is None, victim.stdout.read().decode()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.005)
    victim.send_signal(signal.SIGKILL)
    assert victim.wait() == -signal.SIGKILL
    assert not (tmp_path / "run" / "result.json").exists()  # it really died mid-training
    killed_at = CheckpointStore(str(tmp_path / "ck")).load()["epoch"]
    assert 1 <= killed_at < epochs

    resumed = _helper(tmp_path / "ck", tmp_path / "run", epochs)
    assert resumed.wait(timeout=300) == 0, resumed.stdout.read().decode()[-3000:]
    assert ref.wait(timeout=300) == 0, ref.stdout.read().decode()[-3000:]
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["resumed_from_epoch"] == killed_at and result["epochs_run"] == epochs
    ref_result = json.loads((tmp_path / "ref" / "result.json").read_text())
    assert ref_result["resumed_from_epoch"] is None
    assert strip_speed(result["history"]) == strip_speed(ref_result["history"])
    for name in ("adapter_model.safetensors", adapters.LAYERNORM_BIAS_FILE):
        a, b = load_file(str(tmp_path / "run" / "adapter" / name)), load_file(str(tmp_path / "ref" / "adapter" / name))
        assert_same(a, b)
