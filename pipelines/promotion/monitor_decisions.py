"""The champion monitor's records and decisions: pure functions of the windows (no MLflow, no I/O).

* `canary_decision`: `promote` after `canary_healthy_windows` windows of the current (canary,
  champion) pair with canary AUC >= champion AUC - `canary_auc_tolerance` on the same rows;
  `withdraw` as soon as the latest one is below that; else `wait`.
* `revert_decision`: the champion's metric below reference x (1 - `revert_drop`) in its last
  `revert_windows` measured windows since it became champion => revert to the previous champion.
  `auc`: reference = the holdout AUC recorded at registration (`eval.candidate`, what the gate
  accepted), else its first monitored window. `ctr` means the *live* CTR (`live_ctr`), against its
  first measured window: a labelled partition's CTR is what users did with whatever served, not a
  property of the version scored now, so `revert_metric: ctr` without a live source is a config
  error. A window without the metric (live source down, one class) neither counts nor breaks a
  streak. A revert due holds the canary's decision (its pair restarts with the restored champion).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Iterable

from pipelines.config import GatePolicy

REVERT_KEYS = {"auc": "auc", "ctr": "live_ctr"}


@dataclass(frozen=True)
class Window:
    """model@alias (version) scored on the labelled rows of `day`; a metric that is None is unknown."""

    model: str
    alias: str  # "champion" | "canary"
    version: str
    day: str
    metrics: dict = field(default_factory=dict)
    champion_version: str = ""  # canary windows: the champion scored on the same rows
    order: int = 0  # when it was recorded (ms): orders two windows of one day
    run_id: str = ""
    sha256: str = ""  # content hash of the partition it was scored on

    def value(self, key: str) -> float | None:
        v = self.metrics.get(key)
        return None if v is None or not math.isfinite(float(v)) else float(v)


@dataclass(frozen=True)
class Decision:
    action: str  # canary: promote | withdraw | wait; revert: revert | keep
    reason: str
    days: tuple[str, ...] = ()  # the windows the decision rests on

    def to_dict(self) -> dict:
        return {"action": self.action, "reason": self.reason, "days": list(self.days)}


def ordered(windows: Iterable[Window]) -> list[Window]:
    """Oldest first: by day, then by when they were recorded."""
    return sorted(windows, key=lambda w: (w.day, w.order))


# ----------------------------------------------------------------------------- decisions (pure)
def canary_pairs(windows: Iterable[Window]) -> list[tuple[Window, Window]]:
    """(canary, champion) windows scored on the same day's rows, both with an AUC, oldest first."""
    windows = list(windows)
    champions = {(w.day, w.version): w for w in ordered(windows) if w.alias == "champion"}
    pairs = []
    for c in ordered(w for w in windows if w.alias == "canary"):
        ch = champions.get((c.day, c.champion_version))
        if ch is not None and c.value("auc") is not None and ch.value("auc") is not None:
            pairs.append((c, ch))
    return pairs


def _tail(items: list, keep) -> list:
    """The longest suffix of `items` whose elements all satisfy `keep`."""
    n = 0
    for x in reversed(items):
        if not keep(x):
            break
        n += 1
    return items[len(items) - n :]


def canary_decision(
    windows: Iterable[Window],
    policy: GatePolicy,
    canary_version: str | None = None,
    champion_version: str | None = None,
) -> Decision:
    """promote / withdraw / wait for the current pair (default: the latest paired window's)."""
    pairs = [p for p in canary_pairs(windows) if canary_version is None or p[0].version == str(canary_version)]
    pairs = [p for p in pairs if champion_version is None or p[1].version == str(champion_version)]
    if not pairs:
        return Decision("wait", "no window yet with both canary and champion scored on the same rows")
    cv, chv = pairs[-1][0].version, pairs[-1][1].version
    tol, need = policy.canary_auc_tolerance, policy.canary_healthy_windows
    # the windows since this pair began: a new champion restarts the count
    run = _tail(pairs, lambda p: (p[0].version, p[1].version) == (cv, chv))
    healthy = _tail(run, lambda p: p[0].value("auc") >= p[1].value("auc") - tol)
    if not healthy:
        c, ch = run[-1]
        return Decision(
            "withdraw",
            f"canary v{cv} AUC {c.value('auc'):.4f} < champion v{chv} AUC "
            f"{ch.value('auc'):.4f} - tolerance {tol:g} on dt={c.day}",
            (c.day,),
        )
    shown = healthy[-need:]
    evidence = ", ".join(f"dt={c.day} {c.value('auc'):.4f} vs {ch.value('auc'):.4f}" for c, ch in shown)
    days = tuple(c.day for c, _ in shown)
    if len(healthy) >= need:
        return Decision(
            "promote",
            f"canary v{cv} AUC >= champion v{chv} AUC - {tol:g} in {need} consecutive "
            f"windows (canary vs champion): {evidence}",
            days,
        )
    return Decision(
        "wait", f"{len(healthy)}/{need} healthy windows of canary v{cv} vs champion v{chv}: {evidence}", days
    )


def revert_decision(
    windows: Iterable[Window], reference: float | None, policy: GatePolicy, version: str | None = None
) -> Decision:
    """revert when the champion's metric is below reference x (1 - revert_drop) in each of its last
    `revert_windows` measured windows since it became champion; else keep."""
    key, k = REVERT_KEYS[policy.revert_metric], policy.revert_windows
    champ = ordered(w for w in windows if w.alias == "champion")
    if not champ:
        return Decision("keep", "no champion window yet")
    version = str(version) if version is not None else champ[-1].version
    if reference is None:
        return Decision("keep", f"no reference {key} for champion v{version} yet")
    floor = reference * (1.0 - policy.revert_drop)
    # since it last became champion: an earlier stint of the same version (before a revert) is another story
    run = _tail(champ, lambda w: w.version == version)
    measured = [(w, w.value(key)) for w in run if w.value(key) is not None]
    bad = _tail(measured, lambda m: m[1] < floor)
    where = f"champion v{version} {key} below {floor:.4f} (= reference {reference:.4f} x (1 - {policy.revert_drop:g}))"
    if len(bad) >= k:
        return Decision(
            "revert",
            f"{where} in {k} consecutive windows: " + ", ".join(f"dt={w.day} {v:.4f}" for w, v in bad[-k:]),
            tuple(w.day for w, _ in bad[-k:]),
        )
    latest = f"; latest: dt={measured[-1][0].day} {measured[-1][1]:.4f}" if measured else ""
    return Decision("keep", f"{len(bad)}/{k} windows {where}{latest}")


def reference_value(
    policy: GatePolicy, version_tags: dict, windows: Iterable[Window], version: str
) -> tuple[float | None, str]:
    """(reference of the revert metric for `version`, where it comes from)."""
    key = REVERT_KEYS[policy.revert_metric]
    if key == "auc":
        try:
            auc = json.loads(version_tags.get("eval.candidate") or "null")["auc"]
            if auc is not None and math.isfinite(float(auc)):
                return float(auc), "eval.candidate (holdout AUC at registration)"
        except (TypeError, KeyError, ValueError):
            pass  # tag missing or not the registration's JSON: fall back to the first window
    first = next((w for w in ordered(windows) if w.version == str(version) and w.value(key) is not None), None)
    if first is None:
        return None, "none yet"
    return first.value(key), f"first monitored window dt={first.day} ({first.alias})"
