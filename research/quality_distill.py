"""The "distilled" row of `research.quality`: a cold-start student built like the product's
(pipelines.training.cold_start / distill), under the benchmark's static temporal protocol.

Protocol (`distilled(ctx, stage)`; stage "val" reads only `ctx.fit` + `ctx.fit_base_dir` and scores
`ctx.val`, stage "test" only `ctx.train` + `ctx.base_dir` and scores `ctx.test`):

* no label of the scored part is used. The cold users of the scored part have no labelled rows in
  the training part, so the student's labelled rows are those of the *training part's own* newest
  users, as the product would see them: the users whose first impression falls in the newest
  `recent_fraction` of the training rows ("recent users"), capped at their first
  `ColdStartConfig.labelled_per_entity` rows each. Their rows (all of them, labels unused; the
  newest `max_transfer_rows`) are the transfer set the teacher labels softly. The student thus
  learns how new users differ from the population, not who the scored users are; every row of the
  scored part is scored, as for the other rows of the table (same protocol, directly comparable);
* teacher = the trained base (`ctx.*base_dir`; the benchmark's slot adapters are not handed to the
  hook, and on MovieLens the product's `teacher_fallback` usually picks the base anyway);
* student = that base + a new LoRA adapter with the cold-start shape (`ColdStartConfig.r/alpha/
  target_modules`), A initialised from the behaviour covariance of the transfer users' embeddings,
  trained with `distill.distill` on BCE (labelled rows) + KD + alignment (transfer set), with the
  `ColdStartConfig` defaults for weights, epochs, lr, batch sizes and seed;
* scoring rule: rows whose user has no event in the training part (cold) get the student's pCTR;
  the other (warm) rows get the base's (the student is not meant for them, as in serving).

A protocol that uses the first K labelled rows of each *scored* cold user (as the product does at
serving time) would have to drop those rows from the scoring of every row of the table; it is not
implemented here.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from pipelines.config import ColdStartConfig
from pipelines.model import features, inference, store
from pipelines.model.inference import predict
from pipelines.training import distill as D
from pipelines.training.cold_start import init_student, student_for
from research.quality_protocol import cold_mask, tokens

RECENT_FRACTION = 0.2


def recent_user_rows(
    train: pd.DataFrame,
    recent_fraction: float = RECENT_FRACTION,
    labelled_per_user: int = 10,
    max_transfer_rows: int = 200_000,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(labelled, transfer) rows of the users first seen in the newest `recent_fraction` of `train`
    (time-sorted): labelled = the first `labelled_per_user` rows of each such user (0 = all), transfer
    = all their rows (the newest `max_transfer_rows`)."""
    if not 0.0 < recent_fraction < 1.0:
        raise ValueError(f"recent_fraction must be in (0, 1), got {recent_fraction}")
    f = train.sort_values("event_ts", kind="stable").reset_index(drop=True)
    start = int(round((1.0 - recent_fraction) * len(f)))
    first_row = f.groupby(f["user_id"].astype(str), sort=False).cumcount()
    recent = set(f["user_id"].astype(str)[(first_row == 0) & (f.index >= start)])
    rows = f[f["user_id"].astype(str).isin(recent)]
    rank = first_row[rows.index]
    labelled = rows[rank < labelled_per_user] if labelled_per_user > 0 else rows
    transfer = rows.iloc[max(0, len(rows) - max_transfer_rows) :]
    return labelled.reset_index(drop=True), transfer.reset_index(drop=True)


def make_distilled(cs: ColdStartConfig | None = None, recent_fraction: float = RECENT_FRACTION):
    """The `distilled=` callable for `research.quality.run` (see the module docstring)."""
    cs = cs or ColdStartConfig()

    def distilled(ctx, stage: str) -> np.ndarray:
        if stage == "val":
            tr, base_dir, scored = ctx.fit, ctx.fit_base_dir, ctx.val
        elif stage == "test":
            tr, base_dir, scored = ctx.train, ctx.base_dir, ctx.test
        else:
            raise ValueError(f"stage must be 'val' or 'test', got {stage!r}")

        def tok(frame):
            return tokens(frame, ctx.model_cfg, ctx.drop_fields)

        labelled, transfer = recent_user_rows(tr, recent_fraction, cs.labelled_per_entity, cs.max_transfer_rows)
        x_s = tok(scored)
        teacher = store.load_base(base_dir)
        p_base = predict(teacher, x_s)
        cold = cold_mask(tr, scored)
        if not cold.any() or len(labelled) == 0:
            return p_base
        x_l, y_l = tok(labelled), features.labels(labelled)
        x_t = tok(transfer)
        t_logits, t_pooled = inference.forward_by_group({None: teacher}, x_t, np.zeros(len(x_t), dtype=object))
        student = student_for(store.load_base(base_dir), cs, cs.seed)
        init_student(student, cs, x_t)  # the stage's own init (covariance A by default)
        settings = D.DistillSettings(
            cs.epochs,
            cs.batch_size,
            cs.transfer_batch_size,
            cs.lr,
            cs.weight_decay,
            cs.warmup_steps,
            cs.seed,
            cs.loss_weights,
        )
        torch.manual_seed(cs.seed)
        D.distill(student, (x_l, y_l), D.TransferSet(x_t, t_logits, t_pooled), settings, desc=f"bench-distill-{stage}")
        out = p_base.astype(np.float64)
        out[cold] = predict(student, x_s[cold])
        return out

    return distilled
