"""`python -m research.quality_headroom`: how far above the one-hot LR can *any* model get under the
quality benchmark's protocol (MovieLens-100K, temporal split 80/20, no test-period labels)?

`research.quality` (once `bench quality`) asks our models to beat a one-hot logistic regression by
0.01 AUC overall and on cold users. Our models do not (docs/history.md). This probe asks whether the
protocol leaves that much room at all, by giving a *well-regularised linear model and a gradient-boosted
tree model* everything a CTR engineer would reach for on this data:

* side information MovieLens has but the benchmark's LR does not use: the movie's release year
  (5-year bucket), all of its genres (multi-hot, not only the first), the user's zip-code prefix;
* feature crosses (gender x item, age x item, gender x genre, age x genre, occupation x genre,
  gender x age): the second-order interactions FM / attention models learn;
* causal, label-free behaviour counters, known at serving time from impression logs: how many
  impressions the user and the item had *before* this one (log2 buckets), and the user's "taste",
  the mean training-period positive rate of the items they were shown before;
* recency: training rows weighted by exp(-age / 120 days);
* gradient boosting (scikit-learn HistGradientBoosting) on out-of-fold target-encoded ids.

Every variant's regularisation is chosen on the same validation split as `research.quality` (latest
10 % of the train part), then refit on the whole train part and scored once on test.

And, as a *different* protocol for reference, the few-shot cold start that our cold-start stage
serves in production: the first `k_shot` labelled rows of every cold test user are revealed (the
"support" rows), and the static LR and an LR refit with the support rows are both scored on the
remaining test rows. That is where labels of new users move the numbers; the static protocol
has no such rows by construction.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import pandas as pd
import scipy.sparse as sp
from sklearn.ensemble import HistGradientBoostingClassifier
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import KFold
from sklearn.preprocessing import OneHotEncoder

from pipelines.bench.backtest_lr import LR_C_GRID, LR_FEATURES, fit_lr, predict_lr
from pipelines.bench.backtest_protocol import TRAIN_FRACTION, VAL_FRACTION, temporal_split
from pipelines.data import movielens
from pipelines.metrics import auc
from research.quality_protocol import GOAL_MARGIN, cold_mask, scores

CROSSES = (
    ("gender", "item_id"),
    ("age_bucket", "item_id"),
    ("gender", "category"),
    ("age_bucket", "category"),
    ("occupation", "category"),
    ("gender", "age_bucket"),
)
DECAY_DAYS = 120.0
TASTE_PRIOR_ROWS = 10  # shrinkage of an item's positive rate towards the global rate
K_SHOT = 10


# ------------------------------------------------------------------------------- features
def side_info() -> tuple[pd.DataFrame, pd.DataFrame]:
    """(items: item_id, release_bucket, genres; users: user_id, zip1) from the installed MovieLens files."""
    d = movielens.dataset_dir()
    items = pd.read_csv(d / "ml-100k.item", sep="\t", dtype=str, quoting=3)
    users = pd.read_csv(d / "ml-100k.user", sep="\t", dtype=str)
    items.columns = [c.split(":")[0] for c in items.columns]
    users.columns = [c.split(":")[0] for c in users.columns]
    year = pd.to_numeric(items["release_year"], errors="coerce")
    items = pd.DataFrame(
        {
            "item_id": items["item_id"],
            "genres": items["class"].fillna(""),
            "release_bucket": (year // 5 * 5).fillna(0).astype(int).astype(str),
        }
    )
    return items, pd.DataFrame({"user_id": users["user_id"], "zip1": users["zip_code"].str[:1].fillna("?")})


def add_crosses(frame: pd.DataFrame, pairs=CROSSES) -> pd.DataFrame:
    out = frame.copy()
    for a, b in pairs:
        out[f"{a}*{b}"] = out[a].astype(str) + "|" + out[b].astype(str)
    return out


def add_counters(frame: pd.DataFrame, train: pd.DataFrame) -> pd.DataFrame:
    """Behaviour counters of each row from strictly earlier rows of `frame` (which must be sorted by
    event time): user / item impressions so far (log2 buckets) and the user's taste (mean shrunk
    positive rate, in `train`, of the items the user was shown before). No label of `frame` is read."""
    out = frame.copy()
    out["user_seen"] = np.floor(np.log2(1 + out.groupby("user_id").cumcount())).astype(int).astype(str)
    out["item_seen"] = np.floor(np.log2(1 + out.groupby("item_id").cumcount())).astype(int).astype(str)
    rate = train["label"].mean()
    g = train.groupby("item_id")["label"].agg(["sum", "count"])
    item_rate = out["item_id"].map((g["sum"] + TASTE_PRIOR_ROWS * rate) / (g["count"] + TASTE_PRIOR_ROWS)).fillna(rate)
    before = out.groupby("user_id").cumcount()
    taste_sum = item_rate.groupby(out["user_id"]).cumsum() - item_rate
    out["taste"] = np.where(before > 0, taste_sum / before.clip(lower=1), rate)
    return out


def recency_weights(frame: pd.DataFrame, days: float = DECAY_DAYS) -> np.ndarray:
    age = (frame["event_ts"].max() - frame["event_ts"]).dt.total_seconds().to_numpy() / 86400.0
    return np.exp(-age / days)


# --------------------------------------------------------------------------------- models
def _lr_design(fit: pd.DataFrame, cols, multi_genre: bool, numeric=()):
    """A fitted (frame -> sparse matrix) transform: one-hot of `cols`, optional multi-hot genres and
    standardised numeric columns."""
    enc = OneHotEncoder(handle_unknown="ignore").fit(fit[list(cols)].astype(str))
    genres = sorted(set(" ".join(fit["genres"]).split())) if multi_genre else []
    mu = {c: fit[c].mean() for c in numeric}
    sd = {c: fit[c].std() or 1.0 for c in numeric}

    def transform(f: pd.DataFrame):
        blocks = [enc.transform(f[list(cols)].astype(str))]
        if genres:
            blocks.append(
                sp.csr_matrix(
                    f["genres"].str.get_dummies(sep=" ").reindex(columns=genres, fill_value=0).to_numpy(dtype=float)
                )
            )
        for c in numeric:
            blocks.append(sp.csr_matrix(((f[c] - mu[c]) / sd[c]).to_numpy()[:, None]))
        return sp.hstack(blocks).tocsr()

    return transform


def lr_variant(fit, val, train, test, cols, *, multi_genre=False, numeric=(), decay=False, grid=LR_C_GRID):
    """C chosen on (fit, val), refit on train; returns (test pCTR, chosen C, its val AUC)."""

    def fitted(src: pd.DataFrame, C: float):
        design = _lr_design(src, cols, multi_genre, numeric)
        w = recency_weights(src) if decay else None
        return design, LogisticRegression(C=C, max_iter=3000).fit(design(src), src["label"].to_numpy(), sample_weight=w)

    val_auc = {}
    for C in grid:
        design, m = fitted(fit, C)
        val_auc[C] = auc(val["label"].to_numpy(), m.predict_proba(design(val))[:, 1])
    C = max(val_auc, key=val_auc.get)
    design, m = fitted(train, C)
    return m.predict_proba(design(test))[:, 1], C, round(val_auc[C], 4)


_TE_COLS = ("user_id", "item_id", "gender", "age_bucket", "occupation", "category", "slot")


def _target_encode(src: pd.DataFrame, f: pd.DataFrame, k: float = 10.0) -> pd.DataFrame:
    rate = src["label"].mean()
    out = {}
    for c in _TE_COLS:
        g = src.groupby(c)["label"].agg(["sum", "count"])
        out[c] = f[c].map((g["sum"] + k * rate) / (g["count"] + k)).fillna(rate).to_numpy(dtype=float)
    out["item_count"] = np.log1p(f["item_id"].map(src["item_id"].value_counts()).fillna(0).to_numpy(dtype=float))
    return pd.DataFrame(out, index=f.index)


def _oof_encode(src: pd.DataFrame, folds: int = 5) -> pd.DataFrame:
    """Target encoding of `src`'s own rows out of fold, so a row's label never encodes itself."""
    parts = [_target_encode(src.iloc[a], src.iloc[b]) for a, b in KFold(folds, shuffle=True, random_state=0).split(src)]
    return pd.concat(parts).loc[src.index]


def gbdt_variant(fit, val, train, test, grid=(0.03, 0.1)):
    def fitted(src: pd.DataFrame, lr: float):
        return HistGradientBoostingClassifier(
            learning_rate=lr, max_iter=300, max_leaf_nodes=15, l2_regularization=1.0, random_state=0
        ).fit(_oof_encode(src), src["label"].to_numpy())

    val_auc = {
        lr: auc(val["label"].to_numpy(), fitted(fit, lr).predict_proba(_target_encode(fit, val))[:, 1]) for lr in grid
    }
    lr = max(val_auc, key=val_auc.get)
    return fitted(train, lr).predict_proba(_target_encode(train, test))[:, 1], lr, round(val_auc[lr], 4)


# ---------------------------------------------------------------------------------- probe
def few_shot(train: pd.DataFrame, test: pd.DataFrame, C: float, k: int = K_SHOT) -> dict:
    """Static LR vs LR refit with the first `k` labelled rows of each cold test user, both scored on
    the other test rows (a different protocol, see the module docstring)."""
    cold = cold_mask(train, test)
    support = cold & (test.groupby("user_id").cumcount().to_numpy() < k)
    query, q_cold = test[~support], cold[~support]
    y = query["label"].to_numpy()
    return {
        "k_shot": k,
        "support_rows": int(support.sum()),
        "query_rows": int(len(query)),
        "lr_static": scores(y, predict_lr(fit_lr(train, C), query), q_cold),
        "lr_with_support": scores(y, predict_lr(fit_lr(pd.concat([train, test[support]]), C), query), q_cold),
    }


def run(frame: pd.DataFrame | None = None, k_shot: int = K_SHOT, grid=LR_C_GRID) -> dict:
    """Every variant on MovieLens-100K (or `frame`, with its side-info columns, for tests)."""
    t0 = time.perf_counter()
    if frame is None:
        items, users = side_info()
        frame = movielens.load().merge(items, on="item_id", how="left").merge(users, on="user_id", how="left")
        frame[["genres", "release_bucket", "zip1"]] = frame[["genres", "release_bucket", "zip1"]].fillna("")
    frame = frame.sort_values("event_ts", kind="stable").reset_index(drop=True)
    train, test = temporal_split(frame, TRAIN_FRACTION)
    fit, val = temporal_split(train, 1.0 - VAL_FRACTION)
    # Counters run over the whole time-ordered log (causal by construction); taste reads train labels only,
    # and the fit/val pair reads fit labels only.
    crossed = add_crosses(frame)
    train_c, test_c = temporal_split(add_counters(crossed, train), TRAIN_FRACTION)
    fit_c, val_c = temporal_split(add_counters(crossed.iloc[: len(train)], fit), 1.0 - VAL_FRACTION)
    cold = cold_mask(train, test)
    y = test["label"].to_numpy()
    base = list(LR_FEATURES)
    crosses = [f"{a}*{b}" for a, b in CROSSES]
    variants = {
        "lr_one_hot": dict(cols=base),
        "lr_side_info": dict(cols=base + ["release_bucket", "zip1"], multi_genre=True),
        "lr_crosses": dict(cols=base + crosses),
        "lr_behaviour_counters": dict(cols=base + ["user_seen", "item_seen"], numeric=("taste",)),
        "lr_recency_weighted": dict(cols=base, decay=True),
        "lr_everything": dict(
            cols=base + ["release_bucket", "zip1", "user_seen", "item_seen"] + crosses,
            multi_genre=True,
            numeric=("taste",),
        ),
    }
    rows: dict[str, dict] = {}
    for name, kw in variants.items():
        p, C, v = lr_variant(fit_c, val_c, train_c, test_c, grid=grid, **kw)
        rows[name] = {**scores(y, p, cold), "val_auc": v, "C": C}
    p, lr, v = gbdt_variant(fit, val, train, test)
    rows["gbdt_target_encoded"] = {**scores(y, p, cold), "val_auc": v, "learning_rate": lr}

    ref = rows["lr_one_hot"]
    for r in rows.values():
        r["delta_auc"] = round(r["auc"] - ref["auc"], 4)
        r["delta_auc_cold"] = round(r["auc_cold"] - ref["auc_cold"], 4)
    best = max(rows, key=lambda n: rows[n]["val_auc"])
    return {
        "benchmark": "MovieLens-100K temporal split: headroom above the one-hot LR under the static protocol",
        "rows": rows,
        "chosen_on_validation": best,
        "max_delta_auc": max(r["delta_auc"] for r in rows.values()),
        "max_delta_auc_cold": max(r["delta_auc_cold"] for r in rows.values()),
        "goal_margin": GOAL_MARGIN,
        "few_shot_reference": few_shot(train, test, ref["C"], k_shot),
        "secs": round(time.perf_counter() - t0, 1),
    }


def main() -> int:
    print(json.dumps(run()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
