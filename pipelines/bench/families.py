"""`python -m pipelines bench families [--quick]`: what each shipped model family costs (issue 15), beside the
quality figures of `python -m pipelines backtest --config configs/movielens_<family>.yaml`.

For every family, with its shipped config (`CONFIGS`): the base is built as the base stage builds it
(`Family.build` + `load_pretrained`, not trained: what an adapter costs to train and to serve does not
depend on the base's weights), and one slot-day's adapter is trained exactly as the backtest trains it
(`backtest_models.SlotAdapters`: the config's `lora` section, its trailing `window_days` of the slot's
MovieLens rows before `DAY`). Then base and adapter are logged and registered in a temporary SQLite MLflow
store and loaded back through the trusted registry path (`registry.pyfunc.load`,
`models:/ctr_lora_<slot>@champion`), and batches of 32 MovieLens rows are scored through its `predict`.

One JSON object: per family
* ``adapter_cpu_s``: CPU seconds (process time) to train that adapter, with one intra-op thread;
* ``adapter_rows``: the rows it trained on (the window, before its validation tail);
* ``adapter_bytes``: the adapter's saved files;
* ``pyfunc_p50_ms`` / ``pyfunc_p99_ms``: latency of one `predict` of 32 rows (encode included);
and ``day``, ``slot``, ``threads``. `--quick` trains on a 2-day window and scores fewer batches.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import peft  # noqa: F401  (imported before any clock starts: a first import is no training cost)

from pipelines.bench import serving_demo as demo
from pipelines.bench.backtest_models import SlotAdapters
from pipelines.bench.serving import _temporary_registry
from pipelines.config import REPO_ROOT, load_pipeline_config
from pipelines.data import movielens
from pipelines.model import family
from pipelines.model.inference import configure_threads
from pipelines.registry import mlflow_io, pyfunc
from pipelines.registry.model_input import model_input

CONFIGS = {
    "feature_transformer": "configs/pipeline.yaml",
    "dcn": "configs/movielens_dcn.yaml",
    "minilm_text": "configs/movielens_text.yaml",
}
DAY, SLOT, BATCH = "1998-03-10", "night", 32


def _adapter(cfg, base, rows):
    """(trained PeftModel, CPU seconds, saved bytes) of one slot-day adapter, as the backtest trains it."""
    adapters = SlotAdapters("adapter", cfg, cfg.lora, static=None)
    t = time.process_time()
    model = adapters._fit(base, rows, f"{DAY}/{SLOT}")
    return model, time.process_time() - t, adapters.info()["adapter_bytes"]


def _latency_ms(model, frame, calls: int) -> tuple[float, float]:
    # cut to the signature's columns, as serving sends them (and as evaluation scores)
    batches = [model_input(model, frame.sample(BATCH, random_state=i).reset_index(drop=True)) for i in range(calls)]
    for b in batches[:5]:  # warm-up
        model.predict(b)
    times = []
    for b in batches:
        t = time.perf_counter()
        model.predict(b)
        times.append(1000.0 * (time.perf_counter() - t))
    return float(np.percentile(times, 50)), float(np.percentile(times, 99))


def measure(name: str, frame, quick: bool) -> dict:
    """The figures of one family (see the module doc)."""
    cfg = load_pipeline_config(REPO_ROOT / CONFIGS[name])
    if quick:
        cfg = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, window_days=2, min_rows=1))
    fam = family.resolve(cfg.model.family)
    base = fam.build(cfg.model)
    fam.load_pretrained(base, cfg.model)
    base.eval()
    end = pd.Timestamp(DAY, tz="UTC")
    window = frame[
        (frame["event_ts"] >= end - pd.Timedelta(days=cfg.lora.window_days))
        & (frame["event_ts"] < end)
        & (frame["slot"] == SLOT)
    ]
    adapter, cpu_s, nbytes = _adapter(cfg, base, window)
    scored = frame[frame["event_ts"] >= end]
    example = mlflow_io.input_example(scored, base.cfg)
    with tempfile.TemporaryDirectory() as tmp, _temporary_registry(Path(tmp)) as experiment_id:
        version = demo.register_base(base, example, experiment_id=experiment_id)
        logged = demo.log_adapter(adapter, SLOT, version, example, experiment_id=experiment_id)
        demo.register_adapter(logged, f"ctr_lora_{SLOT}", SLOT, alias="champion", base=version)
        served = pyfunc.load(f"models:/ctr_lora_{SLOT}@champion")
        p50, p99 = _latency_ms(served, scored, 30 if quick else 300)
    return {
        "adapter_cpu_s": round(cpu_s, 3),
        "adapter_rows": int(len(window)),
        "adapter_bytes": nbytes,
        "pyfunc_p50_ms": round(p50, 2),
        "pyfunc_p99_ms": round(p99, 2),
    }


def run(quick: bool = False, names=tuple(CONFIGS)) -> dict:
    os.environ.setdefault("CTR_TORCH_THREADS", "1")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    configure_threads()
    frame = movielens.load()
    return {
        "day": DAY,
        "slot": SLOT,
        "threads": int(os.environ["CTR_TORCH_THREADS"]),
        "quick": quick,
        "families": {n: measure(n, frame, quick) for n in names},
    }
