"""The `backtest` subcommand of `python -m pipelines` (issue 14): its arguments and what it runs."""

from __future__ import annotations

import json
import logging
import tempfile

from pipelines.config import load_pipeline_config
from pipelines.errors import ConfigError


def add_parser(sub) -> None:
    """Add `backtest` to the subparsers `sub` of `python -m pipelines`."""
    bt = sub.add_parser("backtest", help="score every day by models fitted on the days before it (MovieLens)")
    bt.add_argument("--from", dest="day_from", help="first scored day (default: where `bench quality` splits)")
    bt.add_argument("--to", dest="day_to", help="last scored day (default: the last day)")
    bt.add_argument("--days", type=int, help="at most this many scored days")
    bt.add_argument("--only", help="comma-separated comparators (default: all)")
    bt.add_argument(
        "--few-shot",
        type=int,
        metavar="K",
        help="instead: new users scored after their first K labelled rows (the few-shot mode)",
    )
    bt.add_argument(
        "--cut",
        choices=("test", "validation"),
        help="--few-shot: the protocol on the test period (default) or on the rows before it (to choose on)",
    )
    bt.add_argument(
        "--cold-items",
        type=int,
        metavar="K",
        help="instead: every scored row scored by a static base fitted without its item (the items in K "
        "folds): the new-item question asked of every row (--from/--to/--days, --base-cache, --scores)",
    )
    bt.add_argument(
        "--choose",
        choices=("ranks", "orthogonality", "schedule", "delta", "base"),
        help="instead: choose that adapter option on the validation days (base: the base recipe on three "
        "validation cuts), then replay it on the test days (--from/--to; --only: a subset of its "
        "candidates)",
    )
    bt.add_argument("--val-days", type=int, help="--choose: at most this many validation days (the first ones)")
    bt.add_argument("--quick", action="store_true", help="7 days of one slot's rows (a smoke run, minutes)")
    bt.add_argument("--served-dir", help="served: the replay's lake and MLflow store (default: a new temp folder)")
    bt.add_argument("--flip-labels", metavar="DAY", help="served: that day lands with its labels flipped (a fault)")
    bt.add_argument(
        "--faults",
        action="store_const",
        const=True,
        help="instead: the fault suite, six faults injected into the served replay of the --quick days "
        "(every slot); prints what stopped each (--served-dir)",
    )
    bt.add_argument(
        "--ids-all-slots",
        action="store_true",
        help="adapter_ids: one adapter a day for every slot (default: one per slot, as the pipeline)",
    )
    bt.add_argument(
        "--base-cache",
        metavar="DIR",
        help="keep the fitted static base in DIR and load it on a later replay with the same settings "
        "and history (the text family's base costs about 20 CPU minutes)",
    )
    bt.add_argument(
        "--scores",
        metavar="FILE",
        help="also write every scored row's scores to this parquet file (for backtest-compare)",
    )
    bt.add_argument("--config")
    bt.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    bt.add_argument("--report", help="write backtest.html, auc_over_time.png and backtest.json to this folder")
    bt.add_argument(
        "--mlflow",
        action="store_true",
        help="log the result and the report to a run of the ctr-backtest experiment (MLFLOW_TRACKING_URI)",
    )
    bt.set_defaults(fn=cmd)

    cp = sub.add_parser(
        "backtest-compare",
        help="two `backtest --scores` files on the same rows: the paired AUC "
        "difference with its 95%% interval, all / warm / cold / new items",
    )
    cp.add_argument("a", metavar="A[:COMPARATOR]", help="a scores file; its comparator (default static)")
    cp.add_argument("b", metavar="B[:COMPARATOR]", help="the file compared against; its comparator (default static)")
    cp.add_argument("--margin", type=float, help="a goal A - B >= MARGIN: met, missed or undecided per part")
    cp.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    cp.add_argument("--plot", metavar="FILE", help="also draw the differences and intervals (a forest plot) to FILE")
    cp.add_argument(
        "--mlflow",
        action="store_true",
        help="log the comparison and its plot to a run of the ctr-backtest experiment (MLFLOW_TRACKING_URI)",
    )
    cp.set_defaults(fn=cmd_compare)


# The options each mode other than the replay reads (besides --config and --json); any other one given
# with it is refused rather than ignored: `--cold-items 5 --mlflow` would otherwise log nothing, silently.
MODE_OPTIONS = {
    "few_shot": {"cut"},
    "faults": {"served_dir"},
    "choose": {"day_from", "day_to", "days", "only", "base_cache", "val_days"},
    "cold_items": {"day_from", "day_to", "days", "base_cache", "scores"},
}
_FLAGS = {
    "day_from": "--from",
    "day_to": "--to",
    "days": "--days",
    "only": "--only",
    "few_shot": "--few-shot",
    "choose": "--choose",
    "val_days": "--val-days",
    "quick": "--quick",
    "served_dir": "--served-dir",
    "flip_labels": "--flip-labels",
    "ids_all_slots": "--ids-all-slots",
    "base_cache": "--base-cache",
    "scores": "--scores",
    "report": "--report",
    "mlflow": "--mlflow",
    "cold_items": "--cold-items",
    "cut": "--cut",
    "faults": "--faults",
}


def check_mode(a) -> None:
    """At most one mode; a mode given an option it does not read is a ConfigError naming both."""
    modes = [m for m in MODE_OPTIONS if getattr(a, m) is not None]
    if len(modes) > 1:
        raise ConfigError(f"backtest: {' and '.join(_FLAGS[m] for m in modes)} are separate modes; choose one")
    if not modes:
        if a.val_days is not None:
            raise ConfigError("backtest: --val-days is an option of --choose")
        if a.cut is not None:
            raise ConfigError("backtest: --cut is an option of --few-shot")
        return
    unread = [
        _FLAGS[k]
        for k in _FLAGS
        if k not in MODE_OPTIONS[modes[0]] and k != modes[0] and getattr(a, k) not in (None, False)
    ]
    if unread:
        raise ConfigError(f"backtest {_FLAGS[modes[0]]}: it does not read {', '.join(unread)}")


def cmd(a) -> int:
    """`python -m pipelines backtest`: the replay, the few-shot mode, the report, MLflow."""
    from pipelines.bench import backtest

    check_mode(a)
    logging.getLogger(backtest.__name__).setLevel(logging.INFO)  # a line per day: the run takes a while
    if a.few_shot is not None:
        from pipelines.bench import backtest_fewshot

        out = backtest_fewshot.run(load_pipeline_config(a.config), shots=a.few_shot, cut=a.cut or "test")
        print(json.dumps(out) if a.json else backtest_fewshot.table(out))
        return 0
    if a.faults is not None:
        from pipelines.bench import backtest_faults

        out = backtest_faults.run(load_pipeline_config(a.config), served_dir=a.served_dir)
        print(json.dumps(out) if a.json else backtest_faults.table(out))
        return 0
    if a.cold_items is not None:
        from pipelines.bench import backtest_cold_items

        logging.getLogger(backtest_cold_items.__name__).setLevel(logging.INFO)
        out = backtest_cold_items.run(
            load_pipeline_config(a.config),
            folds=a.cold_items,
            day_from=a.day_from,
            day_to=a.day_to,
            max_days=a.days,
            base_cache=a.base_cache,
            scores=a.scores,
        )
        print(json.dumps(out) if a.json else backtest_cold_items.table(out))
        return 0
    if a.choose == "base":
        from pipelines.bench import backtest_base_choice as bbc

        if a.base_cache or a.val_days is not None:  # every candidate is a different base: nothing to cache
            raise ConfigError("backtest --choose base reads neither --base-cache nor --val-days")

        out = bbc.run(
            load_pipeline_config(a.config),
            test=(a.day_from, a.day_to),
            max_days=a.days,
            only=a.only.split(",") if a.only else None,
        )
        print(json.dumps(out) if a.json else bbc.table(out))
        return 0
    if a.choose is not None:
        from pipelines.bench import backtest_choice

        out = backtest_choice.run(
            load_pipeline_config(a.config),
            choice=a.choose,
            test=(a.day_from, a.day_to),
            max_days=a.days,
            only=a.only.split(",") if a.only else None,
            base_cache=a.base_cache,
            val_days=a.val_days,
        )
        print(json.dumps(out) if a.json else backtest_choice.table(out))
        return 0
    out = backtest.run(
        load_pipeline_config(a.config),
        day_from=a.day_from,
        day_to=a.day_to,
        max_days=a.days,
        names=a.only.split(",") if a.only else backtest.COMPARATORS,
        ids_per_slot=not a.ids_all_slots,
        quick=a.quick,
        served_dir=a.served_dir,
        flip_labels=a.flip_labels,
        base_cache=a.base_cache,
        scores=a.scores,
    )
    if a.report or a.mlflow:
        from pipelines.bench import backtest_report

        files = backtest_report.write(out, a.report or tempfile.mkdtemp(prefix="backtest-"))
        out["report"] = files["html"]
        if a.mlflow:
            out["mlflow_run_id"] = backtest_report.log_to_mlflow(out, files)
    if a.json:
        print(json.dumps(out))
    else:
        print(backtest.table(out))
    return 0


def cmd_compare(a) -> int:
    """`python -m pipelines backtest-compare A[:COMPARATOR] B[:COMPARATOR]`."""
    from pipelines.bench import backtest_scores

    (file_a, comp_a), (file_b, comp_b) = _file_and_comparator(a.a), _file_and_comparator(a.b)
    out = backtest_scores.compare(file_a, file_b, comp_a, comp_b, margin=a.margin)
    if a.plot:
        out["plot"] = backtest_scores.figure(out, a.plot)
    if a.mlflow:
        out["mlflow_run_id"] = backtest_scores.log_to_mlflow(out)
    print(json.dumps(out) if a.json else backtest_scores.table(out))
    return 0


def _file_and_comparator(arg: str) -> tuple[str, str]:
    """ "FILE:adapter" -> (FILE, "adapter"); "FILE" -> (FILE, "static"). A suffix with "/" or "." is the path's."""
    path, sep, comparator = arg.rpartition(":")
    if not sep or not comparator or "/" in comparator or "." in comparator:
        return arg, "static"
    return path, comparator
