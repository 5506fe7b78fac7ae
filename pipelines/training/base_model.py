"""Stage: train the frozen base CTR model fully on an early window and log it.

`train` returns a small JSON dict (run id, model URI, fingerprint, metrics, data lineage, and the
`evaluation` the base gate reads: this base and the serving base scored on the same holdout rows);
`flows.base` registers it as `ctr_base@candidate`, gates it and releases it. With
`base_training.refit_all_rows` the holdout only scores the recipe: the base logged is the same recipe
refitted on every row of the window, so the rows nearest what it will serve train it.
"""

from __future__ import annotations

import logging
import tempfile

import mlflow
import numpy as np

from pipelines.config import PipelineConfig, config_hash, to_dict
from pipelines.data.splits import load_split
from pipelines.metrics import summary
from pipelines.model import family, features, store
from pipelines.model.inference import predict
from pipelines.registry import mlflow_io, runs
from pipelines.registry.pyfunc import load_base_from_registry
from pipelines.training.base_fit import fit_base
from pipelines.training.loop import seed_everything

log = logging.getLogger(__name__)


def train(cfg: PipelineConfig, lake_uri: str, cutoff_day: str) -> dict:
    bt = cfg.base_training
    split = load_split(lake_uri, cutoff_day, bt.holdout_fraction, start_day=bt.train_start, min_rows=100)
    fam = family.resolve(cfg.model.family)
    x_tr, y_tr = fam.encode(split.train, cfg.model), features.labels(split.train)
    x_ho, y_ho = fam.encode(split.holdout, cfg.model), features.labels(split.holdout)
    model = _fresh_model(fam, cfg)

    with runs.start_run(mlflow_io.ensure_experiment(cfg.registry.experiment), f"base-{cutoff_day}") as run:
        mlflow.set_tags({"stage": "base_model", "data.cutoff": cutoff_day, "code.version": mlflow_io.code_version()})
        mlflow.log_params({f"model.{k}": v for k, v in to_dict(cfg.model).items()})
        mlflow.log_params({f"train.{k}": v for k, v in to_dict(bt).items()})
        fitted = fit_base(
            model,
            x_tr,
            y_tr,
            bt,
            val=(x_ho, y_ho),
            desc="base",
            on_epoch=lambda m: mlflow.log_metrics({k: v for k, v in m.items() if k != "epoch"}, step=m["epoch"]),
        )
        if fitted["wide"]:
            by_l2 = fitted["wide"].get("auc_by_l2") or {}
            mlflow.log_metrics(
                {
                    **{f"wide_lr_{k}": v for k, v in fitted["wide"].items() if k != "auc_by_l2"},
                    **{f"wide_lr_newest_auc_l2_{k}": v for k, v in by_l2.items()},
                }
            )
        metrics = summary(y_ho, predict(model, x_ho))
        mlflow.log_metrics({f"holdout_{k}": v for k, v in metrics.items() if v is not None})
        evaluation = _against_serving_base(cfg, split.holdout, y_ho, metrics)
        if evaluation["champion"]:
            mlflow.log_metrics({f"serving_base_{k}": v for k, v in evaluation["champion"].items() if v is not None})
        if bt.refit_all_rows:  # the holdout has scored the recipe: what ships learns from its rows too
            model = _refit_all_rows(fam, cfg, (x_tr, x_ho), (y_tr, y_ho))
        mlflow.log_dict(split.lineage, "lineage/data.json")
        with tempfile.TemporaryDirectory() as tmp:
            meta = store.save_base(model, tmp)
            info = mlflow_io.log_ctr_model(
                {"kind": "base", "model": meta["model"]},
                mlflow_io.input_example(split.holdout, model.cfg),
                base_dir=tmp,
            )
        log.info(
            "base model trained on %d rows (%s..%s): holdout AUC %.4f logloss %.4f%s",
            len(split.train),
            split.lineage["first"],
            split.lineage["last"],
            metrics["auc"],
            metrics["logloss"],
            f"; refitted on all {len(split.train) + len(split.holdout)} rows" if bt.refit_all_rows else "",
        )
    return {
        "run_id": run.info.run_id,
        "model_uri": info.model_uri,
        "fingerprint": meta["fingerprint"],
        "metrics": metrics,
        "data": {k: split.lineage[k] for k in ("first", "last", "count", "sha256")},
        "config_hash": config_hash(cfg.model),
        "cutoff": cutoff_day,
        "evaluation": evaluation,
    }


def _fresh_model(fam, cfg: PipelineConfig):
    seed_everything(cfg.base_training.seed)
    model = fam.build(cfg.model)
    fam.load_pretrained(model, cfg.model)
    return model


def _refit_all_rows(fam, cfg: PipelineConfig, tokens: tuple, labels: tuple):
    """The recipe again, from a fresh model and the same seed, on the training rows and the holdout
    together (its wide L2 chosen again, on the newest of those rows); its epoch losses are logged as
    `refit_*`. The gate's evidence stays the holdout run's."""
    model = _fresh_model(fam, cfg)
    x, y = np.concatenate(tokens), np.concatenate(labels)
    fitted = fit_base(
        model,
        x,
        y,
        cfg.base_training,
        desc="base-refit",
        on_epoch=lambda m: mlflow.log_metrics({f"refit_{k}": v for k, v in m.items() if k != "epoch"}, step=m["epoch"]),
    )
    mlflow.log_metrics({"refit_rows": len(y), **({"refit_wide_lr_l2": fitted["wide"]["l2"]} if fitted["wide"] else {})})
    return model


def _against_serving_base(cfg: PipelineConfig, holdout, y_ho, metrics: dict) -> dict:
    """What the base gate compares (`promotion.gate.decide_base`): this base's holdout metrics and the
    serving base's (`<base>@champion`, loaded and checked against its registry fingerprint) on the same
    rows, each encoded with its own model config. No serving base: `champion` is None (a first base).
    A serving base that cannot be loaded raises: it is never read as "there is none"."""
    name = cfg.registry.base_model_name
    serving = mlflow_io.version_by_alias(name, "champion")
    champion = None
    if serving is not None:
        old = load_base_from_registry(name, str(serving.version))
        champion = summary(y_ho, predict(old, family.encode(holdout, old.cfg)))
    return {
        "candidate": metrics,
        "champion": champion,
        "holdout_rows": int(len(y_ho)),
        "champion_version": str(serving.version) if serving is not None else None,
    }
