"""Stage: train one LoRA adapter (one slot) on the frozen serving base, log it to MLflow.

Input: config, the lake URI, the run's logical date (end of the trailing window) and the slot.
Output: a `TrainedAdapter`: the run id, the logged model URI, the base it was trained on, the data
lineage and the metrics; its `to_dict()` is the JSON-safe candidate record the evaluation and
registration stages read (and an Airflow XCom carries). Nothing is registered here (see
pipelines.registry.register).
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
from dataclasses import dataclass

import mlflow
import torch

from pipelines.config import LoraTrainConfig, PipelineConfig, config_hash, to_dict
from pipelines.errors import PipelineError
from pipelines.metrics import summary
from pipelines.model import adapters, features
from pipelines.model.inference import evaluate_arrays
from pipelines.model.stream import StreamSplit, holdout_streams
from pipelines.registry import mlflow_io, runs
from pipelines.registry.models import serving_base, sibling_champions
from pipelines.registry.pyfunc import load_base_from_registry
from pipelines.training import checkpoint, delta
from pipelines.training.delta import loop_settings
from pipelines.training.loop import fit, seed_everything
from pipelines.training.orthogonality import Regularizer, saved_factors

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainedAdapter:
    """A slot's candidate adapter as its training run logged it."""

    run_id: str
    model_uri: str
    model_name: str
    slot: str
    end_day: str
    base: dict  # the serving base it was trained on (registry.models.serving_base: name, version, fingerprint)
    metrics: dict  # on the holdout (metrics.summary); empty when the days after the window judge it
    trainable_fraction: float
    data: dict  # the window's lineage: first, last, count, sha256
    config_hash: str
    judged_on: str  # lora.judged_on: holdout or next_day
    effective_lr: float  # after the stability rule (model.adapters.stable_lr)
    stability: float
    lr_rescaled: bool
    epochs_run: int
    best_epoch: int
    resumed_from_epoch: int | None  # the checkpoint's epoch this run resumed after; None for a fresh run
    orthogonality: dict | None  # the penalty's report against the sibling champions; None without a penalty

    def to_dict(self) -> dict:
        """The candidate record: what evaluation and registration read, JSON-safe for XCom and the CLI."""
        return dataclasses.asdict(self)


def train(
    cfg: PipelineConfig,
    lake_uri: str,
    end_day: str,
    slot: str,
    *,
    checkpoint_uri: str | None = None,
    progress: bool = False,
) -> TrainedAdapter:
    """Train, log and return the candidate adapter of `slot` for the window ending `end_day`.

    Rows stream from the lake's partitions (`model.stream`): memory is bounded by the read chunk
    and the shuffle buffer, not by the window's row count. In lake order (day, file, row: the
    writers store each day sorted by event time) the newest `lora.holdout_fraction` of the slot's
    rows are the evaluation holdout, only scored at the end (and re-read by the evaluation stage), unless
    `lora.judged_on` is next_day: then every row trains and the days after the window judge it;
    the newest `lora.val_fraction` of the rest validate every epoch (early stopping, best epoch kept).
    A checkpoint is written after every epoch to `checkpoint_uri` (default:
    training.checkpoint.default_uri, deterministic per model, end day and config), so re-running a
    killed task resumes it with the same final weights; it is deleted once the model is logged.
    `progress` shows a tqdm bar per epoch.
    """
    if slot not in cfg.data.slots:
        raise PipelineError(f"slot {slot!r} is not configured (data.slots = {list(cfg.data.slots)})")
    lc = cfg.lora
    base_ref = serving_base(cfg)
    stab = adapters.stable_lr(lc)
    base = _serving_base_model(base_ref)
    streams = holdout_streams(cfg, lake_uri, end_day, slot, base.cfg)
    model = _fresh_adapter(lc, base, token_rows(lc, streams, base.cfg))
    regularizer = sibling_regularizer(cfg, slot, base_ref)
    data_lineage = streams.index.lineage()
    sizes = adapters.trainable_fraction(model)
    settings = loop_settings(lc)
    model_name = cfg.adapter_model_name(slot)
    chash = config_hash(lc)
    store = checkpoint.CheckpointStore(
        checkpoint_uri or checkpoint.default_uri(checkpoint.default_root(lake_uri), model_name, end_day, chash)
    )
    # A checkpoint only resumes this exact run: same config, base weights and data.
    run_key = {
        "config_hash": chash,
        "base_fingerprint": base_ref["fingerprint"],
        "data": data_lineage["sha256"],
        "siblings": sorted(regularizer.siblings) if regularizer else None,
    }

    with runs.start_run(mlflow_io.ensure_experiment(cfg.registry.experiment), f"{model_name}-{end_day}") as run:
        _log_inputs(lc, slot, end_day, base_ref, stab, streams, store, sizes, model_name)
        result = _fit_logged(
            model,
            streams,
            settings,
            store,
            run_key,
            model_name,
            progress,
            delta.regularizer(lc, streams.train.rows, regularizer),
        )
        ortho = _log_orthogonality(model, regularizer)
        # judged_on next_day: nothing is held out; the days after the window judge it (promotion.prequential)
        metrics = score_stream(model, streams.holdout) if streams.holdout.rows else {}
        mlflow.log_metrics({f"holdout_{k}": float(v) for k, v in metrics.items() if isinstance(v, (int, float))})
        mlflow.log_dict(data_lineage, "lineage/data.json")
        info = _log_adapter(model, slot, base_ref, lc, streams.holdout if streams.holdout.rows else streams.train)
    store.delete()  # the logged model is the durable result; a re-run retrains deterministically
    return TrainedAdapter(
        run_id=run.info.run_id,
        model_uri=info.model_uri,
        model_name=model_name,
        slot=slot,
        end_day=end_day,
        base=base_ref,
        metrics=metrics,
        trainable_fraction=sizes["trainable_fraction"],
        data={k: data_lineage[k] for k in ("first", "last", "count", "sha256")},
        config_hash=chash,
        judged_on=lc.judged_on,
        effective_lr=stab["effective_lr"],
        stability=stab["stability"],
        lr_rescaled=stab["lr_rescaled"],
        epochs_run=result["epochs_run"],
        best_epoch=result["best_epoch"],
        resumed_from_epoch=result["resumed_from_epoch"],
        orthogonality=ortho,
    )


def sibling_regularizer(cfg: PipelineConfig, slot: str, base_ref: dict):
    """With `lora.orthogonality_lambda` > 0: the penalty against the other slots' serving champions on
    this base (training.orthogonality), else None. None too when no sibling has a champion yet."""
    if cfg.lora.orthogonality_lambda <= 0:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        dirs = sibling_champions(cfg, cfg.adapter_model_name(slot), tmp, base_fingerprint=base_ref["fingerprint"])
        siblings = {who: saved_factors(d) for who, d in dirs.items()}
    if not siblings:
        log.info("lora.orthogonality_lambda is set, but no other slot has a champion on this base: no penalty")
        return None
    return Regularizer(cfg.lora.orthogonality_lambda, siblings)


def _log_orthogonality(model, regularizer) -> dict | None:
    """The penalty's final value and |cos| against the siblings, logged to the active run."""
    if regularizer is None:
        return None
    report = regularizer.report(model)
    mlflow.set_tag("orthogonality.siblings", ",".join(report["siblings"]))
    mlflow.log_metrics(
        {
            k: float(report[v])
            for k, v in (("orthogonality_penalty", "penalty"), ("orthogonality_max_abs_cos", "max_abs_cos"))
            if report[v] is not None
        }
    )
    return report


def _serving_base_model(base_ref: dict):
    """The serving base as a torch module, checked against its registry fingerprint."""
    return load_base_from_registry(base_ref["name"], base_ref["version"], base_ref["fingerprint"])


def token_rows(lc: LoraTrainConfig, streams: StreamSplit, model_cfg) -> dict[str, list[int]] | None:
    """The id rows an adapter with `lora.trainable_tokens` trains: those of every id in its train and val
    rows. The holdout's own new ids are left out, so the gate scores them as tomorrow's unseen ids
    (they keep the base's rows). None when the option is off."""
    if not lc.trainable_tokens:
        return None
    tables = list(lc.trainable_tokens)
    found: dict[str, set[int]] = {t: set() for t in tables}
    end = max(streams.train.hi, streams.val.hi)  # the holdout starts where both end
    for frame in streams.index.frames(0, end, 262_144, columns=tables):
        for t in tables:
            found[t].update(features.id_buckets(frame[t], t, model_cfg))
    return {t: sorted(v) for t, v in found.items()}


def _fresh_adapter(lc: LoraTrainConfig, base, rows: dict[str, list[int]] | None):
    """`base` with a new adapter attached (and the id rows `rows` training, see `token_rows`)."""
    seed_everything(lc.seed)  # LoRA A matrices are drawn at attach time: same seed => same adapter
    return adapters.attach(base, lc, token_rows=rows)


def _log_inputs(
    lc: LoraTrainConfig,
    slot: str,
    end_day: str,
    base_ref: dict,
    stab: dict,
    streams: StreamSplit,
    store,
    sizes: dict,
    model_name: str,
) -> None:
    """Tags, params and sizes of the run, before training."""
    fit_rows, val_rows, holdout = streams.train, streams.val, streams.holdout
    mlflow.set_tags(
        {
            "stage": "lora_adapter",
            "slot": slot,
            "data.end": end_day,
            "base.name": base_ref["name"],
            "base.version": base_ref["version"],
            "base.fingerprint": base_ref["fingerprint"],
            "code.version": mlflow_io.code_version(),
        }
    )
    mlflow.log_params({f"lora.{k}": v for k, v in to_dict(lc).items()})
    mlflow.log_params(
        {
            "train.effective_lr": stab["effective_lr"],
            "train.stability": stab["stability"],
            "train.lr_rescaled": stab["lr_rescaled"],
            "train.rows": fit_rows.rows,
            "train.val_rows": val_rows.rows,
            "train.checkpoint": store.location,
        }
    )
    mlflow.log_metrics({k: float(v) for k, v in sizes.items()})
    log.info(
        "%s: %d train rows, %d val rows, %d holdout rows; trainable %d / %d params (%.4f%%); lr %.6g",
        model_name,
        fit_rows.rows,
        val_rows.rows,
        holdout.rows,
        sizes["trainable_params"],
        sizes["total_params"],
        100 * sizes["trainable_fraction"],
        stab["effective_lr"],
    )


def _fit_logged(
    model, streams: StreamSplit, settings, store, run_key: dict, model_name: str, progress: bool, regularizer=None
) -> dict:
    """`fit` on the train stream (validating on the val stream, if it has rows), every epoch's metrics
    logged to the active run; refuses a model whose trainable weights are no longer finite."""
    val_rows = streams.val
    result = fit(
        model,
        streams.train,
        settings,
        val=val_rows if val_rows.rows else None,
        desc=model_name,
        checkpoint=store,
        run_key=run_key,
        progress=progress,
        regularizer=regularizer,
        on_epoch=lambda m: mlflow.log_metrics(
            {k: float(v) for k, v in m.items() if k != "epoch" and v is not None}, step=m["epoch"]
        ),
    )
    if not all(torch.isfinite(p).all() for p in model.parameters() if p.requires_grad):
        raise PipelineError(
            f"{model_name}: training diverged (non-finite weights) at lr {settings.lr:g}; "
            "lower lora.lr or lora.stability_max"
        )
    mlflow.set_tags(
        {
            "training.resumed_from_epoch": str(result["resumed_from_epoch"]),
            "training.best_epoch": str(result["best_epoch"]),
        }
    )
    mlflow.log_metrics({"epochs_run": result["epochs_run"]})
    return result


def _log_adapter(model, slot: str, base_ref: dict, lc: LoraTrainConfig, holdout):
    """Log the adapter (and its base reference) as the run's CTR pyfunc model; returns MLflow's ModelInfo."""
    with tempfile.TemporaryDirectory() as tmp:
        adapters.save(model, tmp)
        return mlflow_io.log_ctr_model(
            {"kind": "adapter", "slot": slot, "base": base_ref, "lora": to_dict(lc)},
            mlflow_io.input_example(holdout.head(5), model.get_base_model().cfg),
            adapter_dir=tmp,
        )


def score_stream(model, stream) -> dict:
    """Metric summary of `model` over a stream's rows (in order, under no_grad)."""
    y, p = evaluate_arrays(model, stream)
    return summary(y, p)
