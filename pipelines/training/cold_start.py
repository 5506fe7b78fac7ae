"""Stage: a cold-start adapter distilled from the serving champion (detect -> distill -> evaluate -> register).

Cold entities (`detect`): users / items of the window that the serving base never saw (first seen
after its training cutoff, the `data.last` tag of `ctr_base@champion`) or saw fewer than
`cold_start.min_impressions` times in the `history_days` before the window.

Split (`split`): the cold users who showed up last are held out entirely (the evaluation slice:
users the student has never seen, as at serving time); nothing at or after the first of them trains.
Before that: the first `labelled_per_entity` rows of each cold user / item are the labelled rows,
and the cold rows (or the whole window) are the transfer set, labelled softly by the teacher.

Teacher: per slot, the serving `ctr_lora_<slot>@champion` (its base + adapter), or the base itself
when the slot has no champion. With `cold_start.teacher_fallback` the serving base teaches instead
when it predicts the labelled cold rows better (lower logloss) than the slot champions: on MovieLens
the champions, trained on warm-dominated windows, were sometimes worse than the base on new users
(docs/cold_start.md), and distilling a worse teacher drags the student down. The choice uses only
training-period labels and is recorded (`teacher.kind`). Student: the frozen serving base + a new LoRA adapter whose A
matrices come from the covariance of the transfer users' embeddings (pipelines.training.distill),
trained on BCE + distillation + alignment. Baseline: the same adapter shape with PEFT's default
init, trained on the same labelled rows with BCE only and the standard adapter recipe
(`lora.epochs/batch_size/lr/weight_decay/warmup_steps/seed`).

One model for every slot (`cold_start.model_name`, default `ctr_lora_cold_start`): the cold rows
of one slot are too few to train on (MovieLens: ~2,000 labelled rows over three slots), serving
picks it by the user / item being cold, not by slot, and the slot is still one of its inputs. A
run for a single slot (slot=<name>) registers `<model_name>_<slot>`.

Stage functions take (cfg, lake_uri, end_day, ...) and return small JSON-safe dicts; every task
re-reads the lake (the data's lineage hash must not change between tasks), so nothing but URIs and
those dicts passes between them. Deterministic for a seed.
"""

from __future__ import annotations

import logging
import tempfile

import mlflow
import numpy as np
import torch
from peft import LoraConfig, get_peft_model

from pipelines.config import ColdStartConfig, LoraShape, PipelineConfig, config_hash, to_dict
from pipelines.data.cold import ALL, base_of, describe, prepare, same_data, slots_of
from pipelines.metrics import logloss, sigmoid
from pipelines.model import family, features, inference
from pipelines.registry import mlflow_io, runs
from pipelines.registry.models import BASELINE_ARTIFACT, load_teachers, serving_base
from pipelines.registry.pyfunc import load_base_from_registry
from pipelines.training import distill as D
from pipelines.training.loop import seed_everything

log = logging.getLogger(__name__)


def student_for(base, cs: LoraShape, seed: int):
    """base + a fresh LoRA adapter with the cold-start shape (PEFT default init: A kaiming, B = 0)."""
    seed_everything(seed)
    base.requires_grad_(False)
    return get_peft_model(
        base,
        LoraConfig(r=cs.r, lora_alpha=cs.alpha, lora_dropout=0.0, target_modules=list(cs.target_modules), bias="none"),
    )


def init_student(student, cs: ColdStartConfig, transfer_tokens: np.ndarray) -> dict:
    """Apply `cs.init` to a fresh student and describe it (for the run): "covariance" sets LoRA A from
    the covariance of the transfer users' embeddings and records how much of its variance the r
    directions explain; "default" keeps PEFT's init."""
    init = {"init": cs.init}
    if cs.init == "covariance":
        emb, counts = D.user_embedding_rows(student, transfer_tokens[:, 0])
        cov = D.behaviour_covariance(emb, counts)
        vals, _ = D.principal_directions(cov, cs.r)
        D.set_lora_A(student, D.covariance_lora_A(cov, cs.r))
        init.update(
            users=int(len(emb)),
            explained_variance=float(vals.sum() / torch.trace(cov).clamp_min(1e-30)),
            top_eigenvalue=float(vals[0]),
        )
    return init


def choose_teacher(
    teachers: dict, x_labelled: np.ndarray, y_labelled: np.ndarray, slots: np.ndarray, fallback: bool = True
) -> dict:
    """Which model teaches: the slot champions (`teachers`), or the serving base (`teachers[None]`)
    when `fallback` and the base has the lower logloss on the labelled cold rows."""
    champ, _ = inference.forward_by_group(teachers, x_labelled, slots)
    base, _ = inference.forward_by_group({None: teachers[None]}, x_labelled, slots)
    ll = {"champions": logloss(y_labelled, sigmoid(champ)), "base": logloss(y_labelled, sigmoid(base))}
    kind = "base" if fallback and ll["base"] < ll["champions"] else "champions"
    return {"kind": kind, "labelled_logloss": ll}


# ----------------------------------------------------------------------------- stage entry points
def detect_stage(cfg: PipelineConfig, lake_uri: str, end_day: str, slot: str = ALL) -> dict:
    """Detect the cold users / items and size the split; raises PipelineError when there is too little."""
    prep = prepare(cfg, lake_uri, end_day, slot, serving_base(cfg, with_cutoff=True))
    out = describe(cfg, prep, end_day, slot)
    log.info(
        "cold start %s..%s (slot %s, base cutoff %s): %s; rows %s; %d held-out users from %s",
        prep.window_first,
        end_day,
        slot,
        prep.base["cutoff"],
        out["cold"],
        out["rows"],
        out["holdout_users"],
        out["holdout_start"],
    )
    return out


def distill_stage(
    cfg: PipelineConfig, lake_uri: str, end_day: str, slot: str = ALL, detected: dict | None = None
) -> dict:
    """Train the distilled student and the no-distillation baseline; log both to one MLflow run.

    The student is logged as the CTR pyfunc (base reference + adapter), the baseline's adapter as
    the run artifact `baseline_adapter/`. Returns the candidate dict that evaluate / register take.
    """
    cs = cfg.cold_start
    prep = prepare(cfg, lake_uri, end_day, slot, base_of(detected) if detected else serving_base(cfg, with_cutoff=True))
    same_data(prep, detected, "distillation")
    summary = describe(cfg, prep, end_day, slot)
    base_ref, name = summary["base"], summary["model_name"]
    labelled, transfer, teacher, teacher_refs = _teacher_outputs(cfg, prep, slot)
    student = student_for(_registered_base(base_ref), cs, cs.seed)
    init = init_student(student, cs, transfer.tokens)
    settings, baseline_settings = _distill_settings(cfg)

    with runs.start_run(mlflow_io.ensure_experiment(cfg.registry.experiment), f"{name}-{end_day}") as run:
        _log_inputs(cfg, slot, end_day, prep, summary, teacher, teacher_refs, init)
        log.info(
            "%s: %d labelled rows, %d transfer rows; teacher: %s (slot champions %s; logloss on the labelled "
            "cold rows %s); init %s",
            name,
            len(labelled[0]),
            len(transfer),
            teacher["kind"],
            {s: f"{r['model']} v{r['version']}" for s, r in teacher_refs.items()},
            teacher["labelled_logloss"],
            init,
        )
        hist = D.distill(student, labelled, transfer, settings, desc=name, on_epoch=_epoch_logger())
        baseline = student_for(_registered_base(base_ref), cs, cfg.lora.seed)
        b_hist = D.distill(
            baseline, labelled, None, baseline_settings, desc=f"{name}-baseline", on_epoch=_epoch_logger("baseline_")
        )
        info = _log_models(student, baseline, slot, base_ref, cs, prep.split.holdout)
    return {
        **summary,
        "run_id": run.info.run_id,
        "model_uri": info.model_uri,
        "teachers": teacher_refs,
        "teacher": teacher,
        "init": init,
        "config_hash": config_hash(cs),
        "train": {"student_final_loss": hist[-1]["train_loss"], "baseline_final_loss": b_hist[-1]["train_loss"]},
    }


def _registered_base(ref: dict):
    return load_base_from_registry(ref["name"], ref["version"], ref["fingerprint"])


def _teacher_outputs(cfg: PipelineConfig, prep, slot: str):
    """((labelled tokens, labels), the transfer set with the chosen teacher's logits and pooled
    representations, the teacher choice, the teachers' registry refs). The teachers themselves are
    not returned: training needs only their outputs, and they hold a model per slot in memory."""
    sp = prep.split
    teachers, teacher_refs = load_teachers(cfg, slots_of(cfg, slot), base=prep.base)
    mcfg = teachers[None].cfg
    x_l, y_l = family.encode(sp.labelled, mcfg), features.labels(sp.labelled)
    x_t = family.encode(sp.transfer, mcfg)
    teacher = choose_teacher(
        teachers, x_l, y_l, sp.labelled["slot"].astype(str).to_numpy(), cfg.cold_start.teacher_fallback
    )
    if teacher["kind"] == "base":
        teachers = {None: teachers[None]}
    t_logits, t_pooled = inference.forward_by_group(teachers, x_t, sp.transfer["slot"].astype(str).to_numpy())
    return (x_l, y_l), D.TransferSet(x_t, t_logits, t_pooled), teacher, teacher_refs


def _distill_settings(cfg: PipelineConfig):
    """The student's settings (cold_start.*), and the baseline's: the standard adapter recipe (lora.*), BCE only."""
    cs, lc = cfg.cold_start, cfg.lora
    student = D.DistillSettings(
        cs.epochs,
        cs.batch_size,
        cs.transfer_batch_size,
        cs.lr,
        cs.weight_decay,
        cs.warmup_steps,
        cs.seed,
        cs.loss_weights,
    )
    baseline = D.DistillSettings(
        lc.epochs,
        lc.batch_size,
        cs.transfer_batch_size,
        lc.lr,
        lc.weight_decay,
        lc.warmup_steps,
        lc.seed,
        D.LossWeights(1.0, 0.0, 0.0, cs.temperature),
    )
    return student, baseline


def _log_inputs(
    cfg: PipelineConfig, slot: str, end_day: str, prep, summary: dict, teacher: dict, teacher_refs: dict, init: dict
) -> None:
    """Tags, params, sizes and the detection / lineage records of the run, before training."""
    cs, lc, base_ref = cfg.cold_start, cfg.lora, summary["base"]
    mlflow.set_tags(
        {
            "stage": "cold_start",
            "slot": slot,
            "data.end": end_day,
            "base.name": base_ref["name"],
            "base.version": base_ref["version"],
            "base.fingerprint": base_ref["fingerprint"],
            "base.cutoff": prep.base["cutoff"],
            "code.version": mlflow_io.code_version(),
            "teacher.kind": teacher["kind"],
            **{f"teacher.{s}": f"{r['model']} v{r['version']}" for s, r in teacher_refs.items()},
        }
    )
    mlflow.log_params({f"cold_start.{k}": v for k, v in to_dict(cs).items()})
    mlflow.log_params(
        {
            f"baseline.{k}": getattr(lc, k)
            for k in ("epochs", "batch_size", "lr", "weight_decay", "warmup_steps", "seed")
        }
    )
    mlflow.log_metrics(
        {
            **{f"cold_{k}": float(v) for k, v in summary["cold"].items()},
            **{f"rows_{k}": float(v) for k, v in summary["rows"].items()},
            "holdout_users": float(prep.split.holdout_users),
            **{f"teacher_labelled_logloss_{k}": v for k, v in teacher["labelled_logloss"].items()},
            **{f"init_{k}": float(v) for k, v in init.items() if k != "init"},
        }
    )
    mlflow.log_dict({**summary, "teachers": teacher_refs, "teacher": teacher, "init": init}, "cold_start/detected.json")
    mlflow.log_dict(prep.lineage, "lineage/data.json")


def _epoch_logger(prefix: str = ""):
    """An `on_epoch` callback: the epoch's metrics (names prefixed) into the active run, at step = epoch."""
    return lambda m: mlflow.log_metrics({f"{prefix}{k}": v for k, v in m.items() if k != "epoch"}, step=m["epoch"])


def _log_models(student, baseline, slot: str, base_ref: dict, cs: LoraShape, holdout):
    """The student as the run's CTR pyfunc model (base reference + adapter), the baseline's adapter as
    the artifact BASELINE_ARTIFACT; returns the student's ModelInfo."""
    with tempfile.TemporaryDirectory() as tmp:
        student.save_pretrained(f"{tmp}/student")
        baseline.save_pretrained(f"{tmp}/{BASELINE_ARTIFACT}")
        mlflow.log_artifacts(f"{tmp}/{BASELINE_ARTIFACT}", BASELINE_ARTIFACT)
        return mlflow_io.log_ctr_model(
            {
                "kind": "adapter",
                "slot": slot,
                "cold_start": True,
                "base": base_ref,
                "lora": {"r": cs.r, "alpha": cs.alpha, "target_modules": list(cs.target_modules)},
            },
            mlflow_io.input_example(holdout, student.get_base_model().cfg),
            adapter_dir=f"{tmp}/student",
        )
