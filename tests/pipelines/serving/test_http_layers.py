"""An adapter on the top layer only (`lora.layers: [-1]`, the text family's shipped recipe) served by
`python -m pipelines serve` from a real `mlflow server`: the batched stacks give a layer the adapter does
not wrap no LoRA rows, and the HTTP scores equal the registry pyfunc's, beside a slot whose adapter wraps
every layer."""

from __future__ import annotations

import dataclasses
import json
import uuid
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch
import yaml

from pipelines.config import LoraTrainConfig
from pipelines.model.base import CTRModel
from pipelines.registry import mlflow_io, pyfunc
from pipelines.bench import serving_demo as demo
from tests.pipelines.serving import fixtures
from tests.pipelines.serving.http_server import REPO, serve

pytestmark = pytest.mark.slow
TWO_BLOCKS = dataclasses.replace(fixtures.CFG, n_blocks=2)


def _config(tmp_path: Path, base_name: str, prefix: str) -> Path:
    """configs/synthetic.yaml with model names of this test's own (the tracking server is shared)."""
    cfg = yaml.safe_load((REPO / "configs/synthetic.yaml").read_text())
    cfg["registry"].update(base_model_name=base_name, adapter_model_prefix=prefix)
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _adapter_config(name: str) -> dict:
    local = Path(mlflow.artifacts.download_artifacts(f"models:/{name}/1"))
    return json.loads(next(local.rglob("adapter_config.json")).read_text())


def test_a_top_layer_adapter_is_served_over_http_as_the_pyfunc_scores_it(on_mlflow_server, tmp_path):
    prefix = f"layers_{uuid.uuid4().hex[:8]}_"
    torch.manual_seed(0)
    base_model = CTRModel(TWO_BLOCKS).eval()
    example = mlflow_io.input_example(fixtures.rows(20))
    base = demo.register_base(base_model, example, name=f"{prefix}base")
    top = LoraTrainConfig(layers=(-1,))
    for i, slot in enumerate(fixtures.SLOTS):
        demo.add_adapter(
            f"{prefix}{slot}", slot, base, base_model, example, seed=100 + i, lora_cfg=top if slot == "feed" else None
        )
    assert _adapter_config(f"{prefix}feed")["layers_to_transform"] == [1]
    assert _adapter_config(f"{prefix}search")["layers_to_transform"] is None

    frame = fixtures.rows(120, "2024-01-11")
    expected = np.zeros(len(frame))
    for slot, rows in frame.groupby("slot").groups.items():
        expected[rows] = np.asarray(pyfunc.load(f"models:/{prefix}{slot}@champion").predict(frame.loc[rows])).ravel()
    base_only = np.asarray(pyfunc.load(f"models:/{prefix}base@champion").predict(frame)).ravel()
    with serve(tmp_path, config=str(_config(tmp_path, f"{prefix}base", prefix))) as http:
        got = http.score(frame)
    np.testing.assert_allclose(got["predictions"], expected, atol=1e-6, rtol=0)
    feed = (frame["slot"] == "feed").to_numpy()
    assert {r["model"] for r, f in zip(got["served_by"], feed) if f} == {f"{prefix}feed"}
    # the top layer's adapter does move the scores: the equality above is not the base's scores twice
    assert np.abs(np.asarray(got["predictions"])[feed] - base_only[feed]).max() > 1e-3
