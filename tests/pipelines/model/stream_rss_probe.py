"""Peak memory of one LoRA epoch streamed from a synthetic lake (a measurement, not a test: minutes).

    python -m tests.pipelines.model.stream_rss_probe write LAKE_DIR DAYS ROWS_PER_DAY
    python -m tests.pipelines.model.stream_rss_probe stream LAKE_DIR DAYS
    python -m tests.pipelines.model.stream_rss_probe memory LAKE_DIR DAYS     # in-memory path, to compare
    python -m tests.pipelines.model.stream_rss_probe stage LAKE_DIR DAYS      # adapter.train + evaluate, slot feed

Run each mode in its own process: ru_maxrss is the process's peak. Prints one JSON line.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import resource
import sys
import tempfile
import time

START = "2024-01-02"


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def main(mode: str, lake_dir: str, days: int, rows_per_day: int = 0) -> dict:
    from pipelines.config import LoraTrainConfig, ModelConfig
    from pipelines.data.lake import Lake
    from pipelines.data.synthetic import SyntheticSpec, write_days
    from pipelines.model import adapters
    from pipelines.model.base import CTRModel
    from pipelines.training.loop import LoopSettings, fit, seed_everything

    end = (dt.date.fromisoformat(START) + dt.timedelta(days=days - 1)).isoformat()
    t0 = time.perf_counter()
    if mode == "write":
        write_days(Lake(lake_dir), SyntheticSpec(), START, days, rows_per_day)
        from tests.conftest import validate_lake

        validate_lake(lake_dir)  # the stream reads validated days only
        return {"mode": mode, "days": days, "rows": days * rows_per_day, "wall_s": round(time.perf_counter() - t0, 1)}
    if mode == "stage":
        return stage(lake_dir, end, days)
    mcfg, lcfg = ModelConfig(), LoraTrainConfig()
    seed_everything(lcfg.seed)
    model = adapters.attach(CTRModel(mcfg), lcfg)
    settings = LoopSettings(1, lcfg.batch_size, lcfg.lr, lcfg.weight_decay, lcfg.warmup_steps, lcfg.seed)
    before = rss_mib()
    if mode == "stream":
        from pipelines.model.stream import LakeIndex, LakeStream

        index = LakeIndex(lake_dir, end, days=days)
        data = LakeStream(index, 0, index.rows, mcfg)
        rows = index.rows
    else:
        from pipelines.data.lake import concat
        from pipelines.model import features

        frame = concat(Lake(lake_dir).read_window(end, days))
        data = (features.encode(frame, mcfg), features.labels(frame))
        rows = len(frame)
    t1 = time.perf_counter()
    res = fit(model, data, settings)
    return {
        "mode": mode,
        "rows": rows,
        "peak_rss_mib": round(rss_mib()),
        "rss_before_data_mib": round(before),
        "train_s": round(time.perf_counter() - t1, 1),
        "wall_s": round(time.perf_counter() - t0, 1),
        "samples_per_s": round(res["history"][0]["samples_per_s"]),
        "train_loss": res["history"][0]["train_loss"],
    }


def stage(lake_dir: str, end: str, days: int) -> dict:
    """The real stages, `training.adapter.train` (one epoch) then `evaluation.compare.evaluate`, on the
    `feed` slot of the whole window, with a random-init base registered in a throwaway SQLite store."""
    import mlflow

    from pipelines.config import DataConfig, LoraTrainConfig, ModelConfig, PipelineConfig
    from pipelines.data.synthetic import SLOTS
    from pipelines.evaluation.compare import evaluate
    from pipelines.model import store
    from pipelines.model.base import CTRModel
    from pipelines.registry import mlflow_io
    from pipelines.training import adapter

    tmp = tempfile.mkdtemp(prefix="rss-probe-")
    os.chdir(tmp)
    os.environ["CTR_CHECKPOINT_ROOT"] = f"{tmp}/ckpt"
    mlflow.set_tracking_uri(f"sqlite:///{tmp}/mlflow.db")
    cfg = PipelineConfig(
        data=DataConfig(lake_uri=lake_dir, slots=SLOTS),
        model=ModelConfig(),
        lora=LoraTrainConfig(epochs=1, window_days=days, early_stopping_patience=0),
    )
    base = CTRModel(cfg.model)
    import pandas as pd

    from pipelines.data.synthetic import SyntheticSpec, generate_day

    example = mlflow_io.input_example(pd.concat(list(generate_day(SyntheticSpec(), START, 10)), ignore_index=True))
    with mlflow.start_run():
        meta = store.save_base(base, f"{tmp}/base")
        info = mlflow_io.log_ctr_model({"kind": "base", "model": meta["model"]}, example, base_dir=f"{tmp}/base")
    mlflow_io.register(
        info.model_uri, "ctr_base", {"fingerprint": meta["fingerprint"]}, alias="champion", run_id=info.run_id
    )
    before = rss_mib()
    t0 = time.perf_counter()
    cand = adapter.train(cfg, lake_dir, end, "feed").to_dict()
    after_train, t_train = rss_mib(), time.perf_counter() - t0
    ev = evaluate(cfg, lake_dir, cand)
    params = mlflow.get_run(cand["run_id"]).data.params
    return {
        "mode": "stage",
        "partitions": cand["data"]["count"],
        "train_rows": int(params["train.rows"]),
        "val_rows": int(params["train.val_rows"]),
        "holdout_rows": ev["holdout_rows"],
        "rss_before_data_mib": round(before),
        "peak_rss_after_train_mib": round(after_train),
        "peak_rss_after_evaluate_mib": round(rss_mib()),
        "train_s": round(t_train, 1),
        "wall_s": round(time.perf_counter() - t0, 1),
        "holdout_auc": cand["metrics"]["auc"],
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else 0)))
