"""Cold-start entities and the cold-start split: pure functions on frames, no I/O.

Cold entities (`detect`): users / items of the window that the serving base never saw (first seen
after its training cutoff) or saw fewer than `min_impressions` times in the history before the
window. The split (`split`) holds out the cold users who showed up last, entirely, so the
evaluation slice is users the student never saw. `prepare` reads a window from the lake and applies
both; the cold-start stages (training.cold_start, evaluation.cold_start) start from it.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

import numpy as np
import pandas as pd

from pipelines.config import PipelineConfig
from pipelines.data.lake import Lake, concat, lineage
from pipelines.data.validated import read_validated_window
from pipelines.errors import PipelineError

ALL = "all"  # a cold-start run over every slot (one model), as opposed to one slot's


@dataclass(frozen=True)
class ColdEntities:
    """Cold users / items: `new_*` first seen after the base's cutoff, `sparse_*` with fewer than
    `min_impressions` impressions in the history before the window."""

    new_users: frozenset
    sparse_users: frozenset
    new_items: frozenset
    sparse_items: frozenset

    @property
    def users(self) -> frozenset:
        return self.new_users | self.sparse_users

    @property
    def items(self) -> frozenset:
        return self.new_items | self.sparse_items

    def counts(self) -> dict:
        return {
            "new_users": len(self.new_users),
            "sparse_users": len(self.sparse_users - self.new_users),
            "cold_users": len(self.users),
            "new_items": len(self.new_items),
            "sparse_items": len(self.sparse_items - self.new_items),
            "cold_items": len(self.items),
        }


def detect(
    history: pd.DataFrame, window: pd.DataFrame, cutoff: str, min_impressions: int, items: bool = True
) -> ColdEntities:
    """Cold entities among those with impressions in `window`.

    - new: no impression on or before `cutoff` (the last day the base model trained on) in
      `history` or `window` (i.e. first seen after the cutoff);
    - sparse: fewer than `min_impressions` impressions in `history` (the rows before the window).
    """
    cut = pd.Timestamp(cutoff, tz="UTC") + pd.Timedelta(days=1)  # cutoff is a whole day
    both = pd.concat(
        [history[["event_ts", "user_id", "item_id"]], window[["event_ts", "user_id", "item_id"]]], ignore_index=True
    )
    seen_by_base = both[both["event_ts"] < cut]
    out = {}
    for col, key in (("user_id", "users"), ("item_id", "items")):
        present = set(window[col].astype(str).unique())
        if key == "items" and not items:
            out[key] = (frozenset(), frozenset())
            continue
        known = set(seen_by_base[col].astype(str).unique())
        counts = history[col].astype(str).value_counts()
        sparse = {e for e in present if counts.get(e, 0) < min_impressions}
        out[key] = (frozenset(present - known), frozenset(sparse))
    return ColdEntities(
        new_users=out["users"][0], sparse_users=out["users"][1], new_items=out["items"][0], sparse_items=out["items"][1]
    )


def cold_mask(frame: pd.DataFrame, cold: ColdEntities) -> np.ndarray:
    """Rows whose user or item is cold."""
    return (frame["user_id"].astype(str).isin(cold.users) | frame["item_id"].astype(str).isin(cold.items)).to_numpy()


@dataclass
class ColdSplit:
    labelled: pd.DataFrame  # the few labelled cold rows (BCE)
    transfer: pd.DataFrame  # rows the teacher labels softly (distillation, alignment, covariance)
    holdout: pd.DataFrame  # every row of the held-out cold users (evaluation only)
    holdout_start: str  # the first impression of the held-out users: nothing at or after it trains
    holdout_users: int


def split(
    window: pd.DataFrame, cold: ColdEntities, holdout_fraction: float, labelled_per_entity: int, transfer: str = "cold"
) -> ColdSplit:
    """Entity-level temporal split of the window.

    The cold users who showed up last (by their first impression in the window) are held out: all
    of their rows are the evaluation slice, and nothing at or after the first of them trains, so
    the held-out users are users the student has never seen (as a new user is at serving time).
    Before that moment: `labelled` = cold rows, capped at the first `labelled_per_entity` rows of
    each cold user (cold-item rows of warm users: of each cold item); 0 = no cap. `transfer` = the
    cold rows (`"cold"`) or every row (`"window"`) before that moment; labels are not used on it.
    """
    frame = window.sort_values(["event_ts", "user_id", "item_id"], kind="stable").reset_index(drop=True)
    uid = frame["user_id"].astype(str)
    cold_users = uid.isin(cold.users)
    first = frame[cold_users].groupby(uid[cold_users], sort=False)["event_ts"].min().sort_values(kind="stable")
    if first.empty:
        raise ValueError("no cold users in the window: nothing to hold out")
    n_hold = max(1, int(round(len(first) * holdout_fraction)))
    if n_hold >= len(first):
        raise ValueError(f"only {len(first)} cold users: cannot hold out {n_hold} and train on the rest")
    t_h = first.iloc[len(first) - n_hold]
    holdout_users = set(first.index[first >= t_h])
    holdout = frame[uid.isin(holdout_users)].reset_index(drop=True)
    before = frame[frame["event_ts"] < t_h]
    mask = cold_mask(before, cold)
    cold_rows = before[mask]
    if labelled_per_entity > 0:
        u = cold_rows["user_id"].astype(str)
        by_user = u.isin(cold.users)
        rank_u = cold_rows.groupby(u, sort=False).cumcount()
        rank_i = cold_rows.groupby(cold_rows["item_id"].astype(str), sort=False).cumcount()
        keep = np.where(by_user, rank_u < labelled_per_entity, rank_i < labelled_per_entity)
        cold_rows = cold_rows[keep]
    if transfer not in ("cold", "window"):
        raise ValueError(f"transfer must be 'cold' or 'window', got {transfer!r}")
    tr = before[mask] if transfer == "cold" else before
    return ColdSplit(
        labelled=cold_rows.reset_index(drop=True),
        transfer=tr.reset_index(drop=True),
        holdout=holdout,
        holdout_start=t_h.isoformat(),
        holdout_users=len(holdout_users),
    )


def cap_transfer(transfer: pd.DataFrame, max_rows: int) -> pd.DataFrame:
    """The newest `max_rows` rows (the frame is time-sorted)."""
    return transfer if len(transfer) <= max_rows else transfer.iloc[len(transfer) - max_rows :].reset_index(drop=True)


# ----------------------------------------------------------------------------- a window, prepared
def model_name(cfg: PipelineConfig, slot: str = ALL) -> str:
    return cfg.cold_start.model_name if slot == ALL else f"{cfg.cold_start.model_name}_{slot}"


def slots_of(cfg: PipelineConfig, slot: str) -> list[str]:
    return list(cfg.data.slots) if slot == ALL else [slot]


@dataclass
class Prepared:
    base: dict
    cold: ColdEntities
    split: ColdSplit
    lineage: dict
    window_first: str
    rows_window: int
    rows_cold: int


def read_days(cfg: PipelineConfig) -> int:
    """Days `prepare` reads, ending at the run's day: the history before the window, then the window.
    All of them must be validated (the detection counts impressions in the history)."""
    return cfg.cold_start.window_days + cfg.cold_start.history_days


def prepare(cfg: PipelineConfig, lake_uri: str, end_day: str, slot: str, base: dict) -> Prepared:
    """Read history + window from the lake (validated partitions only), detect the cold entities and
    split the window.

    `base` (name, version, fingerprint, cutoff) is the serving base at detection; later tasks pass
    the one detection used, so a base promoted in between cannot change the split under them.
    """
    cs = cfg.cold_start
    if slot != ALL and slot not in cfg.data.slots:
        raise PipelineError(f"slot {slot!r} is not configured (data.slots = {list(cfg.data.slots)}, or 'all')")
    window_first = (dt.date.fromisoformat(end_day) - dt.timedelta(days=cs.window_days - 1)).isoformat()
    parts = read_validated_window(Lake(lake_uri), end_day, read_days(cfg))
    in_window = [p for p in parts if p.dt >= window_first]
    if not in_window:
        raise PipelineError(f"no partitions in {lake_uri} for the window {window_first}..{end_day}")
    history = (
        concat([p for p in parts if p.dt < window_first]) if len(in_window) < len(parts) else concat(in_window).iloc[:0]
    )
    window = concat(in_window)
    cold = detect(history, window, base["cutoff"], cs.min_impressions, items=cs.detect_items)
    scoped = window if slot == ALL else window[window["slot"].astype(str) == slot]
    try:
        sp = split(scoped, cold, cs.holdout_fraction, cs.labelled_per_entity, cs.transfer)
    except ValueError as exc:
        raise PipelineError(f"cold start for the window {window_first}..{end_day} (slot {slot}): {exc}") from exc
    sp.transfer = cap_transfer(sp.transfer, cs.max_transfer_rows)
    for what, n, key in (
        ("labelled", len(sp.labelled), "min_labelled_rows"),
        ("held-out", len(sp.holdout), "min_holdout_rows"),
    ):
        if n < getattr(cs, key):
            raise PipelineError(
                f"only {n} {what} cold rows in the window {window_first}..{end_day} (slot {slot}); "
                f"need at least {getattr(cs, key)} (cold_start.{key})"
            )
    return Prepared(
        base=base,
        cold=cold,
        split=sp,
        lineage=lineage(parts),
        window_first=window_first,
        rows_window=int(len(scoped)),
        rows_cold=int(cold_mask(scoped, cold).sum()),
    )


def describe(cfg: PipelineConfig, prep: Prepared, end_day: str, slot: str) -> dict:
    """The JSON-safe summary of a prepared window that every cold-start task passes on."""
    sp = prep.split
    return {
        "end_day": end_day,
        "slot": slot,
        "model_name": model_name(cfg, slot),
        "cutoff": prep.base["cutoff"],
        "base": {k: prep.base[k] for k in ("name", "version", "fingerprint", "family") if k in prep.base},
        "window": {"first": prep.window_first, "last": end_day},
        "data": {k: prep.lineage[k] for k in ("first", "last", "count", "sha256")},
        "cold": prep.cold.counts(),
        "rows": {
            "window": prep.rows_window,
            "cold": prep.rows_cold,
            "labelled": int(len(sp.labelled)),
            "transfer": int(len(sp.transfer)),
            "holdout": int(len(sp.holdout)),
        },
        "holdout_users": sp.holdout_users,
        "holdout_start": sp.holdout_start,
    }


def same_data(prep: Prepared, earlier: dict | None, what: str) -> None:
    if earlier is not None and earlier["data"]["sha256"] != prep.lineage["sha256"]:
        raise PipelineError(
            f"the lake data changed between detection and {what} (lineage "
            f"{earlier['data']['sha256'][:12]} != {prep.lineage['sha256'][:12]}); re-run the DAG"
        )


def base_of(summary: dict) -> dict:
    """The base (with its cutoff) recorded by detect / distill."""
    return {**summary["base"], "cutoff": summary["cutoff"]}
