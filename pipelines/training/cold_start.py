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

import datetime as dt
import json
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipelines.config import PipelineConfig, config_hash, to_dict
from pipelines.errors import PipelineError
from pipelines.training.cold_entities import ColdEntities, ColdSplit, cap_transfer, cold_mask, detect, split

log = logging.getLogger(__name__)

ALL = "all"
BASELINE_ARTIFACT = "baseline_adapter"


# ----------------------------------------------------------------------------- stage plumbing
def model_name(cfg: PipelineConfig, slot: str = ALL) -> str:
    return cfg.cold_start.model_name if slot == ALL else f"{cfg.cold_start.model_name}_{slot}"


def serving_base(cfg: PipelineConfig) -> dict:
    """ctr_base@champion: name, version, fingerprint, and its training cutoff (`data.last`)."""
    from pipelines.registry import mlflow_io

    name = cfg.registry.base_model_name
    mv = mlflow_io.version_by_alias(name, "champion")
    if mv is None:
        raise PipelineError(f"no serving base model: {name}@champion is not set; run the ctr_base_model DAG first")
    cutoff = mv.tags.get("data.last")
    if not cutoff:
        raise PipelineError(f"{name} v{mv.version} has no data.last tag: its training cutoff is unknown")
    return {"name": name, "version": str(mv.version), "fingerprint": mv.tags["fingerprint"], "cutoff": cutoff}


@dataclass
class Prepared:
    base: dict
    cold: ColdEntities
    split: ColdSplit
    lineage: dict
    window_first: str
    rows_window: int
    rows_cold: int


def prepare(cfg: PipelineConfig, lake_uri: str, end_day: str, slot: str = ALL, base: dict | None = None) -> Prepared:
    """Read history + window from the lake, detect the cold entities and split the window.

    `base` (name, version, fingerprint, cutoff) defaults to the serving base; later tasks pass the
    one detection used, so a base promoted in between cannot change the split under them.
    """
    from pipelines.data.lake import Lake, concat, lineage

    cs = cfg.cold_start
    if slot != ALL and slot not in cfg.data.slots:
        raise PipelineError(f"slot {slot!r} is not configured (data.slots = {list(cfg.data.slots)}, or 'all')")
    base = base or serving_base(cfg)
    window_first = (dt.date.fromisoformat(end_day) - dt.timedelta(days=cs.window_days - 1)).isoformat()
    parts = Lake(lake_uri).read_window(end_day, cs.window_days + cs.history_days)
    in_window = [p for p in parts if p.dt >= window_first]
    if not in_window:
        raise PipelineError(f"no partitions in {lake_uri} for the window {window_first}..{end_day}")
    history = concat([p for p in parts if p.dt < window_first]) if len(in_window) < len(parts) else \
        concat(in_window).iloc[:0]
    window = concat(in_window)
    cold = detect(history, window, base["cutoff"], cs.min_impressions, items=cs.detect_items)
    scoped = window if slot == ALL else window[window["slot"].astype(str) == slot]
    try:
        sp = split(scoped, cold, cs.holdout_fraction, cs.labelled_per_entity, cs.transfer)
    except ValueError as exc:
        raise PipelineError(f"cold start for the window {window_first}..{end_day} (slot {slot}): {exc}") from exc
    sp.transfer = cap_transfer(sp.transfer, cs.max_transfer_rows)
    for what, n, key in (("labelled", len(sp.labelled), "min_labelled_rows"),
                         ("held-out", len(sp.holdout), "min_holdout_rows")):
        if n < getattr(cs, key):
            raise PipelineError(f"only {n} {what} cold rows in the window {window_first}..{end_day} (slot {slot}); "
                                f"need at least {getattr(cs, key)} (cold_start.{key})")
    return Prepared(base=base, cold=cold, split=sp, lineage=lineage(parts), window_first=window_first,
                    rows_window=int(len(scoped)), rows_cold=int(cold_mask(scoped, cold).sum()))


def _summary(cfg: PipelineConfig, prep: Prepared, end_day: str, slot: str) -> dict:
    sp = prep.split
    return {"end_day": end_day, "slot": slot, "model_name": model_name(cfg, slot), "cutoff": prep.base["cutoff"],
            "base": {k: prep.base[k] for k in ("name", "version", "fingerprint")},
            "window": {"first": prep.window_first, "last": end_day},
            "data": {k: prep.lineage[k] for k in ("first", "last", "count", "sha256")},
            "cold": prep.cold.counts(),
            "rows": {"window": prep.rows_window, "cold": prep.rows_cold, "labelled": int(len(sp.labelled)),
                     "transfer": int(len(sp.transfer)), "holdout": int(len(sp.holdout))},
            "holdout_users": sp.holdout_users, "holdout_start": sp.holdout_start}


def _same_data(prep: Prepared, earlier: dict | None, what: str) -> None:
    if earlier is not None and earlier["data"]["sha256"] != prep.lineage["sha256"]:
        raise PipelineError(f"the lake data changed between detection and {what} (lineage "
                            f"{earlier['data']['sha256'][:12]} != {prep.lineage['sha256'][:12]}); re-run the DAG")


def _base_of(summary: dict) -> dict:
    """The base (with its cutoff) recorded by detect / distill."""
    return {**summary["base"], "cutoff": summary["cutoff"]}


def load_teachers(cfg: PipelineConfig, slots, refs: dict | None = None,
                  base: dict | None = None) -> tuple[dict, dict]:
    """The teacher of each slot: `ctr_lora_<slot>@champion` (base + adapter), else the serving base.

    Returns ({slot: model, None: serving base}, {slot: ref}). With `refs` (from an earlier task),
    the recorded versions are loaded, not the current aliases, so every task sees the same teacher;
    `base` likewise (default: the serving base).
    """
    import mlflow.artifacts

    from pipelines.registry import mlflow_io
    from pipelines.registry.pyfunc import load_base_from_registry
    from pipelines.training import lora

    base = base or serving_base(cfg)
    models: dict = {None: load_base_from_registry(base["name"], base["version"], base["fingerprint"])}
    out_refs = {}
    for slot in slots:
        name = cfg.adapter_model_name(slot)
        if refs is not None:
            ref = refs[slot]
            version = ref["version"] if ref["kind"] == "adapter" else None
        else:
            mv = mlflow_io.version_by_alias(name, "champion")
            version = str(mv.version) if mv is not None else None
        if version is None:
            models[slot] = models[None]
            out_refs[slot] = {"kind": "base", "model": base["name"], "version": base["version"],
                              "data_last": base["cutoff"]}
            continue
        mv = mlflow_io.get_version(name, version)
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{name}/{version}"))
        meta = json.loads((local / "artifacts" / "meta.json").read_text())
        b = meta["base"]
        models[slot] = lora.load(load_base_from_registry(b["name"], b["version"], b["fingerprint"]),
                                 str(local / "artifacts" / "adapter"))
        out_refs[slot] = {"kind": "adapter", "model": name, "version": version, "data_last": mv.tags.get("data.last"),
                          "base_version": str(b["version"])}
    return models, out_refs


def _slots(cfg: PipelineConfig, slot: str) -> list[str]:
    return list(cfg.data.slots) if slot == ALL else [slot]


def _student(base, cs, seed: int):
    """base + a fresh LoRA adapter with the cold-start shape (PEFT default init: A kaiming, B = 0)."""
    from peft import LoraConfig, get_peft_model

    from pipelines.training.loop import seed_everything

    seed_everything(seed)
    base.requires_grad_(False)
    return get_peft_model(base, LoraConfig(r=cs.r, lora_alpha=cs.alpha, lora_dropout=0.0,
                                           target_modules=list(cs.target_modules), bias="none"))


def _sigmoid(logits: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.asarray(logits, dtype=np.float64)))


def choose_teacher(teachers: dict, x_labelled: np.ndarray, y_labelled: np.ndarray, slots: np.ndarray,
                   fallback: bool = True) -> dict:
    """Which model teaches: the slot champions (`teachers`), or the serving base (`teachers[None]`)
    when `fallback` and the base has the lower logloss on the labelled cold rows."""
    from pipelines.evaluation.metrics import logloss
    from pipelines.training import distill as D

    champ, _ = D.forward_by_group(teachers, x_labelled, slots)
    base, _ = D.forward_by_group({None: teachers[None]}, x_labelled, slots)
    ll = {"champions": logloss(y_labelled, _sigmoid(champ)), "base": logloss(y_labelled, _sigmoid(base))}
    kind = "base" if fallback and ll["base"] < ll["champions"] else "champions"
    return {"kind": kind, "labelled_logloss": ll}


# ----------------------------------------------------------------------------- stage entry points
def detect_stage(cfg: PipelineConfig, lake_uri: str, end_day: str, slot: str = ALL) -> dict:
    """Detect the cold users / items and size the split; raises PipelineError when there is too little."""
    prep = prepare(cfg, lake_uri, end_day, slot)
    out = _summary(cfg, prep, end_day, slot)
    log.info("cold start %s..%s (slot %s, base cutoff %s): %s; rows %s; %d held-out users from %s",
             prep.window_first, end_day, slot, prep.base["cutoff"], out["cold"], out["rows"], out["holdout_users"],
             out["holdout_start"])
    return out


def distill_stage(cfg: PipelineConfig, lake_uri: str, end_day: str, slot: str = ALL,
                  detected: dict | None = None) -> dict:
    """Train the distilled student and the no-distillation baseline; log both to one MLflow run.

    The student is logged as the CTR pyfunc (base reference + adapter), the baseline's adapter as
    the run artifact `baseline_adapter/`. Returns the candidate dict that evaluate / register take.
    """
    import mlflow
    import torch

    from pipelines.model import features
    from pipelines.registry import mlflow_io
    from pipelines.registry.pyfunc import load_base_from_registry
    from pipelines.training import distill as D

    cs = cfg.cold_start
    prep = prepare(cfg, lake_uri, end_day, slot, base=_base_of(detected) if detected else None)
    _same_data(prep, detected, "distillation")
    summary = _summary(cfg, prep, end_day, slot)
    base_ref, sp, name = summary["base"], prep.split, summary["model_name"]
    teachers, teacher_refs = load_teachers(cfg, _slots(cfg, slot), base=prep.base)
    mcfg = teachers[None].cfg
    x_l, y_l = features.encode(sp.labelled, mcfg), features.labels(sp.labelled)
    x_t = features.encode(sp.transfer, mcfg)
    teacher = choose_teacher(teachers, x_l, y_l, sp.labelled["slot"].astype(str).to_numpy(), cs.teacher_fallback)
    if teacher["kind"] == "base":
        teachers = {None: teachers[None]}
    t_logits, t_pooled = D.forward_by_group(teachers, x_t, sp.transfer["slot"].astype(str).to_numpy())
    transfer = D.TransferSet(x_t, t_logits, t_pooled)
    del teachers

    student = _student(load_base_from_registry(base_ref["name"], base_ref["version"], base_ref["fingerprint"]),
                       cs, cs.seed)
    init = {"init": cs.init}
    if cs.init == "covariance":
        emb, counts = D.user_embedding_rows(student, x_t[:, 0])
        cov = D.behaviour_covariance(emb, counts)
        vals, _ = D.principal_directions(cov, cs.r)
        D.set_lora_A(student, D.covariance_lora_A(cov, cs.r))
        init.update(users=int(len(emb)), explained_variance=float(vals.sum() / torch.trace(cov).clamp_min(1e-30)),
                    top_eigenvalue=float(vals[0]))
    weights = D.LossWeights(cs.w_bce, cs.w_kd, cs.w_align, cs.temperature, cs.align)
    settings = D.DistillSettings(cs.epochs, cs.batch_size, cs.transfer_batch_size, cs.lr, cs.weight_decay,
                                 cs.warmup_steps, cs.seed, weights)
    lc = cfg.lora  # the baseline: the standard adapter recipe, BCE only, PEFT default init
    baseline_settings = D.DistillSettings(lc.epochs, lc.batch_size, cs.transfer_batch_size, lc.lr, lc.weight_decay,
                                          lc.warmup_steps, lc.seed, D.LossWeights(1.0, 0.0, 0.0, cs.temperature))

    with mlflow.start_run(experiment_id=mlflow_io.ensure_experiment(cfg.registry.experiment),
                          run_name=f"{name}-{end_day}") as run:  # not set_experiment: it exports MLFLOW_EXPERIMENT_ID
        mlflow.set_tags({"stage": "cold_start", "slot": slot, "data.end": end_day, "base.name": base_ref["name"],
                         "base.version": base_ref["version"], "base.fingerprint": base_ref["fingerprint"],
                         "base.cutoff": prep.base["cutoff"], "code.version": mlflow_io.code_version(),
                         "teacher.kind": teacher["kind"],
                         **{f"teacher.{s}": f"{r['model']} v{r['version']}" for s, r in teacher_refs.items()}})
        mlflow.log_params({f"cold_start.{k}": v for k, v in to_dict(cs).items()})
        mlflow.log_params({f"baseline.{k}": getattr(lc, k) for k in ("epochs", "batch_size", "lr", "weight_decay",
                                                                     "warmup_steps", "seed")})
        mlflow.log_metrics({**{f"cold_{k}": float(v) for k, v in summary["cold"].items()},
                            **{f"rows_{k}": float(v) for k, v in summary["rows"].items()},
                            "holdout_users": float(sp.holdout_users),
                            **{f"teacher_labelled_logloss_{k}": v for k, v in teacher["labelled_logloss"].items()},
                            **{f"init_{k}": float(v) for k, v in init.items() if k != "init"}})
        mlflow.log_dict({**summary, "teachers": teacher_refs, "teacher": teacher, "init": init},
                        "cold_start/detected.json")
        mlflow.log_dict(prep.lineage, "lineage/data.json")
        log.info("%s: %d labelled rows, %d transfer rows; teacher: %s (slot champions %s; logloss on the labelled "
                 "cold rows %s); init %s", name, len(x_l), len(x_t), teacher["kind"],
                 {s: f"{r['model']} v{r['version']}" for s, r in teacher_refs.items()}, teacher["labelled_logloss"],
                 init)
        hist = D.distill(student, (x_l, y_l), transfer, settings, desc=name,
                         on_epoch=lambda m: mlflow.log_metrics({k: v for k, v in m.items() if k != "epoch"},
                                                               step=m["epoch"]))
        baseline = _student(load_base_from_registry(base_ref["name"], base_ref["version"], base_ref["fingerprint"]),
                            cs, lc.seed)
        b_hist = D.distill(baseline, (x_l, y_l), None, baseline_settings, desc=f"{name}-baseline",
                           on_epoch=lambda m: mlflow.log_metrics(
                               {f"baseline_{k}": v for k, v in m.items() if k != "epoch"}, step=m["epoch"]))
        with tempfile.TemporaryDirectory() as tmp:
            student.save_pretrained(f"{tmp}/student")
            baseline.save_pretrained(f"{tmp}/{BASELINE_ARTIFACT}")
            mlflow.log_artifacts(f"{tmp}/{BASELINE_ARTIFACT}", BASELINE_ARTIFACT)
            info = mlflow_io.log_ctr_model({"kind": "adapter", "slot": slot, "cold_start": True, "base": base_ref,
                                            "lora": {"r": cs.r, "alpha": cs.alpha,
                                                     "target_modules": list(cs.target_modules)}},
                                           mlflow_io.input_example(sp.holdout), adapter_dir=f"{tmp}/student")
    return {**summary, "run_id": run.info.run_id, "model_uri": info.model_uri, "teachers": teacher_refs,
            "teacher": teacher, "init": init, "config_hash": config_hash(cs),
            "train": {"student_final_loss": hist[-1]["train_loss"], "baseline_final_loss": b_hist[-1]["train_loss"]}}


def evaluate_stage(cfg: PipelineConfig, lake_uri: str, candidate: dict) -> dict:
    """AUC / logloss on the held-out cold users of (a) the slot champions as they serve those rows
    today (`champions`), (b) the no-distillation baseline and (c) the distilled student, plus the
    serving base alone (`base`), logged to the student's run (`eval_<who>_<metric>`).

    For the gate, `candidate` is the student and `champion` is the serving `<model_name>@champion`
    on the same rows (None on the first run: absolute thresholds). The slot champions are reported,
    not gated against: they usually trained on part of the held-out users' rows (`teacher_saw_holdout`).
    """
    import mlflow

    from pipelines.evaluation.metrics import summary as metric_summary
    from pipelines.evaluation.model_input import predict_pctr
    from pipelines.model import features
    from pipelines.registry import mlflow_io
    from pipelines.registry.pyfunc import load_base_from_registry
    from pipelines.training import distill as D
    from pipelines.training import lora
    from pipelines.training.loop import predict

    slot, name = candidate["slot"], candidate["model_name"]
    prep = prepare(cfg, lake_uri, candidate["end_day"], slot, base=_base_of(candidate))
    _same_data(prep, candidate, "evaluation")
    rows = prep.split.holdout
    if len(rows) != candidate["rows"]["holdout"] or prep.split.holdout_start != candidate["holdout_start"]:
        raise PipelineError(f"the held-out cold rows differ from the ones distillation set aside ({len(rows)} rows from "
                            f"{prep.split.holdout_start} vs {candidate['rows']['holdout']} from "
                            f"{candidate['holdout_start']}): the cold_start config changed between tasks; re-run the DAG")
    y = features.labels(rows)
    teachers, _ = load_teachers(cfg, _slots(cfg, slot), refs=candidate["teachers"], base=prep.base)
    x = features.encode(rows, teachers[None].cfg)
    t_logits, _ = D.forward_by_group(teachers, x, rows["slot"].astype(str).to_numpy())
    base_only = metric_summary(y, predict(teachers[None], x))  # for reference: the serving base alone
    del teachers
    champions = metric_summary(y, _sigmoid(t_logits))
    b = candidate["base"]
    local = mlflow.artifacts.download_artifacts(run_id=candidate["run_id"], artifact_path=BASELINE_ARTIFACT)
    baseline = metric_summary(y, predict(lora.load(load_base_from_registry(b["name"], b["version"], b["fingerprint"]),
                                                   local), x))
    student = metric_summary(y, predict_pctr(mlflow.pyfunc.load_model(candidate["model_uri"]), rows))  # the served path
    champion_mv = mlflow_io.version_by_alias(name, "champion")
    champion = None
    if champion_mv is not None:
        champion = metric_summary(y, predict_pctr(mlflow.pyfunc.load_model(f"models:/{name}/{champion_mv.version}"),
                                                   rows))
    start_day = candidate["holdout_start"][:10]
    saw = sorted(s for s, r in candidate["teachers"].items() if r.get("data_last") and r["data_last"] >= start_day)
    result = {"model_name": name, "slot": slot, "candidate": student, "champion": champion,
              "champion_version": str(champion_mv.version) if champion_mv else None,
              "holdout_rows": int(len(rows)), "holdout_users": candidate["holdout_users"],
              "holdout_start": candidate["holdout_start"],
              "cold_slice": {"champions": champions, "baseline": baseline, "student": student, "base": base_only},
              "teacher": candidate["teacher"]["kind"], "teacher_saw_holdout": saw}
    c = mlflow_io.client()
    for who, m in (("champions", champions), ("baseline", baseline), ("student", student), ("base", base_only),
                   ("candidate", student), ("champion", champion)):
        for k, v in (m or {}).items():
            if isinstance(v, (int, float)) and v is not None:
                c.log_metric(candidate["run_id"], f"eval_{who}_{k}", float(v))
    c.log_dict(candidate["run_id"], result, "cold_start/evaluation.json")

    def fmt(m):
        return "n/a" if m is None or m["auc"] is None else f"AUC {m['auc']:.4f} logloss {m['logloss']:.4f}"

    log.info("%s on %d rows of %d held-out cold users: slot champions %s | baseline %s | student %s | base %s | "
             "%s@champion %s%s", name, len(rows), candidate["holdout_users"], fmt(champions), fmt(baseline),
             fmt(student), fmt(base_only), name,
             f"v{result['champion_version']} {fmt(champion)}" if champion else "none (first run)",
             f" (the champions of {saw} trained on data up to or past the holdout start {start_day}: their numbers "
             f"are optimistic)" if saw else "")
    return result


def register_stage(cfg: PipelineConfig, candidate: dict, evaluation: dict) -> dict:
    """Register the student like any candidate (lineage tags, alias `candidate`) plus the cold-start tags."""
    from pipelines.registry import mlflow_io
    from pipelines.registry.register import register

    out = register(cfg, candidate, evaluation)
    c = mlflow_io.client()
    tags = {"cold_start": "true", "cold_start.cutoff": candidate["cutoff"],
            "cold_start.holdout_start": candidate["holdout_start"],
            "cold_start.teachers": json.dumps({s: f"{r['model']} v{r['version']}"
                                               for s, r in candidate["teachers"].items()}, sort_keys=True),
            "cold_start.teacher": candidate["teacher"]["kind"],
            "cold_start.eval": json.dumps(evaluation["cold_slice"], sort_keys=True),
            "cold_start.counts": json.dumps(candidate["cold"], sort_keys=True)}
    for k, v in tags.items():
        c.set_model_version_tag(out["model"], out["version"], k, v)
    return out


def run_all(cfg: PipelineConfig, lake_uri: str, end_day: str, slot: str = ALL, policy=None, actor: str = "cli") -> dict:
    """detect -> distill -> evaluate -> register -> gate, in-process (the CLI's path)."""
    from pipelines.config import load_gate_policy
    from pipelines.promotion.release import gate_and_release

    detected = detect_stage(cfg, lake_uri, end_day, slot)
    candidate = distill_stage(cfg, lake_uri, end_day, slot, detected=detected)
    evaluation = evaluate_stage(cfg, lake_uri, candidate)
    registered = register_stage(cfg, candidate, evaluation)
    decision = gate_and_release(policy or load_gate_policy(), registered["model"], registered["version"],
                                evaluation, actor=actor)
    return {"detected": detected, "model": registered["model"], "version": registered["version"],
            "evaluation": evaluation, "gate": {k: decision[k] for k in ("passed", "first_run", "promoted")}}
