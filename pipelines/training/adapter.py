"""Stage: train one LoRA adapter (one slot) on the frozen serving base, log it to MLflow.

Input: config, the lake URI, the run's logical date (end of the trailing window) and the slot.
Output: a JSON-safe dict with the run id, the logged model URI, the base it was trained on, the
data lineage and the metrics. Nothing is registered here (see pipelines.registry.register).
"""
from __future__ import annotations

import logging
import tempfile

from pipelines.config import PipelineConfig, config_hash, to_dict
from pipelines.errors import PipelineError

log = logging.getLogger(__name__)


def serving_base(cfg: PipelineConfig) -> dict:
    """The base model version behind ctr_base@champion (what adapters are trained on and served with)."""
    from pipelines.registry import mlflow_io

    name = cfg.registry.base_model_name
    mv = mlflow_io.version_by_alias(name, "champion")
    if mv is None:
        raise PipelineError(f"no serving base model: {name}@champion is not set; run the ctr_base_model DAG first")
    return {"name": name, "version": str(mv.version), "fingerprint": mv.tags["fingerprint"]}


def train(cfg: PipelineConfig, lake_uri: str, end_day: str, slot: str) -> dict:
    import mlflow

    from pipelines.evaluation.metrics import summary
    from pipelines.model import features
    from pipelines.registry import mlflow_io
    from pipelines.registry.pyfunc import load_base_from_registry
    from pipelines.training import lora
    from pipelines.training.data import load_split
    from pipelines.training.loop import LoopSettings, predict, seed_everything, train as train_loop

    if slot not in cfg.data.slots:
        raise PipelineError(f"slot {slot!r} is not configured (data.slots = {list(cfg.data.slots)})")
    lc = cfg.lora
    base_ref = serving_base(cfg)
    split = load_split(lake_uri, end_day, lc.holdout_fraction, days=lc.window_days, slot=slot, min_rows=lc.min_rows)
    seed_everything(lc.seed)  # LoRA A matrices are drawn at attach time: same seed => same adapter
    model = lora.attach(load_base_from_registry(base_ref["name"], base_ref["version"], base_ref["fingerprint"]), lc)
    mcfg = model.get_base_model().cfg
    x_tr, y_tr = features.encode(split.train, mcfg), features.labels(split.train)
    x_ho, y_ho = features.encode(split.holdout, mcfg), features.labels(split.holdout)
    sizes = lora.trainable_fraction(model)
    settings = LoopSettings(lc.epochs, lc.batch_size, lc.lr, lc.weight_decay, lc.warmup_steps, lc.seed)
    model_name = cfg.adapter_model_name(slot)

    mlflow.set_experiment(experiment_id=mlflow_io.ensure_experiment(cfg.registry.experiment))
    with mlflow.start_run(run_name=f"{model_name}-{end_day}") as run:
        mlflow.set_tags({"stage": "lora_adapter", "slot": slot, "data.end": end_day,
                         "base.name": base_ref["name"], "base.version": base_ref["version"],
                         "base.fingerprint": base_ref["fingerprint"], "code.version": mlflow_io.code_version()})
        mlflow.log_params({f"lora.{k}": v for k, v in to_dict(lc).items()})
        mlflow.log_metrics({k: float(v) for k, v in sizes.items()})
        log.info("%s: %d train rows, %d holdout rows; trainable %d / %d params (%.4f%%)", model_name,
                 len(split.train), len(split.holdout), sizes["trainable_params"], sizes["total_params"],
                 100 * sizes["trainable_fraction"])
        train_loop(model, x_tr, y_tr, settings, val=(x_ho, y_ho), desc=model_name,
                   on_epoch=lambda m: mlflow.log_metrics({k: v for k, v in m.items() if k != "epoch"}, step=m["epoch"]))
        metrics = summary(y_ho, predict(model, x_ho))
        mlflow.log_dict(split.lineage, "lineage/data.json")
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            info = mlflow_io.log_ctr_model({"kind": "adapter", "slot": slot, "base": base_ref, "lora": to_dict(lc)},
                                           mlflow_io.input_example(split.holdout), adapter_dir=tmp)
    return {"run_id": run.info.run_id, "model_uri": info.model_uri, "model_name": model_name, "slot": slot,
            "end_day": end_day, "base": base_ref, "metrics": metrics, "trainable_fraction": sizes["trainable_fraction"],
            "data": {k: split.lineage[k] for k in ("first", "last", "count", "sha256")},
            "config_hash": config_hash(lc)}
