"""When a new `ctr_base@champion` may take over serving: a pure decision, no I/O.

An adapter is only ever served on the base it was trained on (its `base.fingerprint` tag), so a base
change cannot happen alias by alias: the new base and the adapter champions trained on it go live
together, in one routing-table swap, once *every* champion the server watches names a version trained
on the new base. Until then the old base keeps serving with its adapters; an alias that already names
a version of the new base keeps its old-base version meanwhile ("held"), it is not a refusal.

A canary still on the old base does not hold the switch back: canaries are optional and a canary on
the old base cannot serve on the new one, so it is left out of the new table (and reported).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pipelines.serving.loader import CHAMPION, Route, VersionRef

FINGERPRINT_TAG = "base.fingerprint"


@dataclass(frozen=True)
class BasePlan:
    """ready: switch now; on_new: the routes the new base's table serves; held: routes the current base
    keeps serving with their current version (their alias names a new-base version); waiting: why not
    ready ("<model>@champion: v3 is on another base"); dropped: routes left out at the switch."""

    ready: bool
    on_new: Mapping[Route, VersionRef]
    held: frozenset[Route]
    waiting: tuple[str, ...]
    dropped: tuple[str, ...]


def trained_on(ref: VersionRef) -> str | None:
    """The fingerprint of the base `ref` was trained on, as its registry version records it."""
    return ref.tags.get(FINGERPRINT_TAG) or None


def plan(
    resolved: Mapping[Route, VersionRef], new_fingerprint: str, refused: Mapping[str, str] | None = None
) -> BasePlan:
    """What to do with `resolved` ((model, alias) -> version) while a base with `new_fingerprint` waits.

    `refused` maps version keys the new base refused (integrity, unsupported...) to the reason: a
    champion the new base cannot load keeps the switch waiting, like one trained on another base.
    """
    refused = refused or {}
    on_new = {r: ref for r, ref in resolved.items() if trained_on(ref) == new_fingerprint and ref.key not in refused}
    waiting, dropped = [], []
    for (model, alias), ref in sorted(resolved.items()):
        if (model, alias) in on_new:
            continue
        why = (
            f"v{ref.version} was refused by the new base ({refused[ref.key]})"
            if ref.key in refused
            else f"v{ref.version} is on another base"
        )
        (waiting if alias == CHAMPION else dropped).append(f"{model}@{alias}: {why}")
    held = frozenset(r for r, ref in resolved.items() if trained_on(ref) == new_fingerprint)
    return BasePlan(not waiting, on_new, held, tuple(waiting), tuple(dropped))
