"""`python -m pipelines <stage> ...`: every stage runs without Airflow.

Tracking and S3 come from the standard MLFLOW_TRACKING_URI and AWS_ENDPOINT_URL variables.
Exit codes: 0 ok, 1 invalid data / refused move / rejected candidate, 2 usage or config error,
3 unexpected error (one line naming the stage and the exception; --verbose adds the traceback),
130 interrupted.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import sys
import traceback

from pipelines.config import load_gate_policy, load_pipeline_config
from pipelines.errors import ConfigError, DataValidationError, PipelineError, PromotionError


def _print(obj) -> None:
    print(json.dumps(obj, indent=2, default=str))


def cmd_generate(a) -> int:
    from pipelines.data.lake import Lake

    lake = Lake(a.out)
    if a.source == "movielens":
        from pipelines.data import movielens

        written = movielens.write_days(lake, a.days, overwrite=a.overwrite, progress=sys.stderr.isatty())
    else:
        from pipelines.data import synthetic

        spec = synthetic.SyntheticSpec(seed=a.seed)
        written = synthetic.write_days(
            lake, spec, a.start_day, a.days or 7, a.rows_per_day, progress=True, overwrite=a.overwrite
        )
    _print(
        {
            "out": a.out,
            "source": a.source,
            "partitions": len(written),
            "first": written[0] if written else None,
            "last": written[-1] if written else None,
        }
    )
    return 0


def cmd_validate(a) -> int:
    from pipelines.validation.stage import validate_uri

    report = validate_uri(
        load_pipeline_config(a.config), a.data, a.reference, a.report_dir
    )  # raises DataValidationError -> exit 1
    print(
        f"VALID {a.data}: {report['rows']} rows, {report.get('evaluated', 0)} checks passed"
        + (f", drift vs {len(a.reference)} reference partitions OK" if a.reference else "")
    )
    for w in report.get("warnings", []):
        print(f"WARN {w['check']}: {w.get('observed')} vs {w.get('expected')}")
    unseen = (report.get("drift") or {}).get("unseen")
    if unseen:
        print(f"unseen ids vs reference: users {unseen['user_rate']:.1%}, items {unseen['item_rate']:.1%}")
    return 0


def cmd_train_base(a) -> int:
    from pipelines.flows import base, windows
    from pipelines.training import base_model

    cfg = load_pipeline_config(a.config)
    lake = a.data or cfg.data.lake_uri
    if a.register:
        from pipelines.registry import lock

        lock.backend()  # no registry lock to move @champion with: refuse now, not after validating
    windows.validate_first(cfg, lake, a.cutoff, windows.base_days(cfg, a.cutoff))
    if not a.register:
        _print(base_model.train(cfg, lake, a.cutoff))
        return 0
    out = base.run(cfg, lake, a.cutoff, policy=load_gate_policy(a.policy))
    _print(out)
    return 0 if out["passed"] else 1  # a rejected base: the serving base stays, and the exit code says so


def cmd_train_adapter(a) -> int:
    from pipelines.flows import retrain, windows
    from pipelines.promotion import gate
    from pipelines.training import adapter

    cfg = load_pipeline_config(a.config)
    lake = a.data or cfg.data.lake_uri
    windows.validate_first(cfg, lake, a.end_day, windows.adapter_days(cfg))
    if not a.register:
        _print(adapter.train(cfg, lake, a.end_day, a.slot, progress=sys.stderr.isatty()).to_dict())
        return 0
    decision = retrain.run(cfg, load_gate_policy(a.policy), lake, a.end_day, a.slot, progress=sys.stderr.isatty())
    if decision.get("judged_on") == "next_day":  # judged the waiting ones, then trained one that waits
        for j in decision["judged"]["judged"]:
            print(f"{decision['model']} v{j['version']} on {a.end_day}: {j['verdict']} ({j.get('reason')})")
        if decision["decision"]:
            print(gate.format_table(decision["decision"]))
        print(f"{decision['model']} v{decision['version']}: registered, waits to be judged on the next validated day")
        return 1 if decision["release_refused"] else 0
    print(gate.format_table(decision))
    return 0 if decision["passed"] else 1


def cmd_cold_start(a) -> int:
    from pipelines.flows import cold_start, windows

    cfg = load_pipeline_config(a.config)
    lake = a.data or cfg.data.lake_uri
    windows.validate_first(cfg, lake, a.end_day, windows.cold_start_days(cfg))
    result = cold_start.run_all(cfg, lake, a.end_day, a.slot, policy=load_gate_policy(a.policy))
    _print(result)
    return 0 if result["gate"]["passed"] else 1


def version_arg(text: str) -> str:
    """argparse type of --version / --to-version: the version as the registry names it (the one
    normalisation, `aliases.version_id`); anything but a positive integer is a usage error (exit 2)."""
    from pipelines.promotion.aliases import version_id

    try:
        return version_id(text)
    except PromotionError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def cmd_promote(a) -> int:
    from pipelines.promotion import aliases

    policy = load_gate_policy(a.policy)  # approval: true also holds for a promote by hand
    _print(aliases.promote(a.model, a.version, reason=a.reason, actor=a.actor, require_approval=policy.approval))
    return 0


def cmd_override(a) -> int:
    from pipelines.promotion import release

    _print(release.override(a.model, a.version, reason=a.reason, actor=a.actor))
    return 0


def cmd_approve(a) -> int:
    """A person's answer, recorded on the version; "Approve" then releases it as the policy says (the
    CLI's counterpart of the DAGs' approve_release + release)."""
    from pipelines.promotion import release

    at = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    record = release.record_approval(a.model, a.version, answer=a.answer, by=a.actor, at=at, task="cli")
    out = {"approval": record}
    if a.answer == "Approve":
        out["release"] = release.release(load_gate_policy(a.policy), a.model, a.version, actor=a.actor)
    _print(out)
    return 0


def cmd_revert(a) -> int:
    from pipelines.promotion import aliases

    _print(aliases.revert(a.model, reason=a.reason, to_version=a.to_version, actor=a.actor))
    return 0


def cmd_history(a) -> int:
    from pipelines.promotion import aliases

    for entry in aliases.history(a.model, a.alias):
        print(json.dumps(entry))
    return 0


def cmd_status(a) -> int:
    from pipelines.registry.status import format_status, status

    models = status(load_pipeline_config(a.config))
    print(json.dumps(models, indent=2) if a.json else format_status(models))
    return 0


def cmd_monitor(a) -> int:
    from pipelines.promotion import live_metrics, monitor

    cfg, policy = load_pipeline_config(a.config), load_gate_policy(a.policy)
    out = monitor.monitor_day(
        cfg,
        policy,
        a.data or cfg.data.lake_uri,
        a.day,
        live=live_metrics.from_policy(policy),
        actor="cli",
        apply_reverts=not a.dry_run,
    )
    _print(out)
    return 1 if out.get("errors") else 0


def cmd_bench(a) -> int:
    if a.which == "training":
        from pipelines.bench import training as bench_training

        print(json.dumps(bench_training.run(quick=a.quick)))
    elif a.which == "serving":
        from pipelines.bench import serving as bench_serving

        print(json.dumps(bench_serving.run(quick=a.quick)))
    elif a.which == "families":
        from pipelines.bench import families as bench_families

        print(json.dumps(bench_families.run(quick=a.quick)))
    else:
        from pipelines.bench import validation as bench

        print(json.dumps(bench.bench_validation(rows=200_000 if a.quick else 1_000_000)))
    return 0


VERBOSE_HELP = "log at INFO, and print the full traceback of an unexpected error"


def _add_move_commands(sub) -> None:
    """promote, revert, override and approve: a person moving an alias (or answering), on the record."""
    for name, fn, helptext in (
        ("promote", cmd_promote, "make a gated version @champion"),
        ("revert", cmd_revert, "put the previous (or a named) champion back"),
        ("override", cmd_override, "release a rejected version to @champion (recorded)"),
        ("approve", cmd_approve, "record a person's answer; Approve releases as the policy says"),
    ):
        s = sub.add_parser(name, help=helptext)
        s.add_argument("--model", required=True)
        if name == "revert":
            s.add_argument("--to-version", type=version_arg, help="default: the previous champion")
        else:
            s.add_argument("--version", required=True, type=version_arg, help="a version number, e.g. 3")
        if name == "approve":
            s.add_argument("--answer", required=True, choices=["Approve", "Reject"])
        else:
            s.add_argument("--reason", required=True, help="why (recorded; at most 1,000 characters)")
        if name in ("promote", "approve"):
            s.add_argument("--policy", help="gate policy YAML (default configs/gate_policy.yaml)")
        s.add_argument(
            "--actor",
            required=name == "approve",
            default=None if name == "approve" else "cli",
            help="who is acting (recorded)",
        )
        s.set_defaults(fn=fn)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pipelines", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    sub = p.add_subparsers(dest="stage", required=True, metavar="<stage>")

    g = sub.add_parser("generate", help="write click-log partitions (dt=YYYY-MM-DD) to s3:// or a directory")
    g.add_argument("--source", choices=["synthetic", "movielens"], required=True)
    g.add_argument("--out", required=True, help="s3://bucket/prefix or a local directory")
    g.add_argument("--days", type=int, help="number of days (movielens: first N days; synthetic: default 7)")
    g.add_argument("--rows-per-day", type=int, default=100_000, help="synthetic only")
    g.add_argument("--start-day", default="2026-01-01", help="synthetic only: first day")
    g.add_argument("--seed", type=int, default=7, help="synthetic only")
    g.add_argument(
        "--overwrite",
        action="store_true",
        help="replace partitions that already exist (their old parts are kept until the new ones are "
        "committed); without it, writing a day that exists is refused",
    )
    g.set_defaults(fn=cmd_generate)

    v = sub.add_parser("validate", help="validate one partition; exit 1 with one line per failed check")
    v.add_argument("--data", required=True, help="a partition: s3://.../dt=YYYY-MM-DD or a local directory")
    v.add_argument(
        "--reference",
        nargs="+",
        metavar="URI",
        help="reference partitions (e.g. the trailing validated days): enables volume, "
        "label-rate-vs-reference and drift checks",
    )
    v.add_argument("--report-dir", help="write report.html and report.json here")
    v.add_argument("--config", help="pipeline YAML (default configs/pipeline.yaml)")
    v.set_defaults(fn=cmd_validate)

    b = sub.add_parser("train-base", help="train the base model on data up to --cutoff (and register it)")
    b.add_argument("--cutoff", required=True, help="last day of training data, YYYY-MM-DD")
    b.add_argument("--data", help="lake URI (default: data.lake_uri)")
    b.add_argument("--config")
    b.add_argument("--policy", help="gate policy YAML (default configs/gate_policy.yaml)")
    b.add_argument(
        "--register",
        action="store_true",
        help="register as ctr_base@candidate, gate it against the serving base, release it to @champion",
    )
    b.set_defaults(fn=cmd_train_base)

    t = sub.add_parser("train-adapter", help="train one slot's LoRA adapter (and evaluate/register/gate it)")
    t.add_argument("--slot", required=True)
    t.add_argument("--end-day", required=True, help="last day of the trailing window, YYYY-MM-DD")
    t.add_argument("--data", help="lake URI (default: data.lake_uri)")
    t.add_argument("--config")
    t.add_argument("--policy", help="gate policy YAML (default configs/gate_policy.yaml)")
    t.add_argument("--register", action="store_true", help="evaluate, register, run the gate")
    t.set_defaults(fn=cmd_train_adapter)

    cs = sub.add_parser("cold-start", help="distil a cold-start adapter from the champion, evaluate, register, gate")
    cs.add_argument("--end-day", required=True, help="last day of the window, YYYY-MM-DD")
    cs.add_argument("--slot", default="all", help="a configured slot, or all (default)")
    cs.add_argument("--data", help="lake URI (default: data.lake_uri)")
    cs.add_argument("--config")
    cs.add_argument("--policy", help="gate policy YAML (default configs/gate_policy.yaml)")
    cs.set_defaults(fn=cmd_cold_start)

    _add_move_commands(sub)

    h = sub.add_parser("history", help="print the alias history as JSON lines, oldest first")
    h.add_argument("--model", required=True)
    h.add_argument("--alias", default="champion")
    h.set_defaults(fn=cmd_history)

    st = sub.add_parser("status", help="registered versions, evaluations, gate results, aliases and history")
    st.add_argument("--config")
    st.add_argument("--json", action="store_true", help="print JSON instead of a table")
    st.set_defaults(fn=cmd_status)

    bn = sub.add_parser("bench", help="one benchmark, printed as one JSON object (make bench runs them all)")
    bn.add_argument("which", choices=["training", "validation", "serving", "families"])
    bn.add_argument("--quick", action="store_true", help="a short run (training: under a minute, serving: about 2)")
    bn.set_defaults(fn=cmd_bench)

    from pipelines.bench import backtest_cli

    backtest_cli.add_parser(sub)

    from pipelines.serving import cli as serving_cli

    serving_cli.add_parser(sub)

    mo = sub.add_parser("monitor", help="score @champion / @canary on one validated day; promote, withdraw, revert")
    mo.add_argument("--day", required=True, help="the partition date (YYYY-MM-DD)")
    mo.add_argument("--data", help="lake URI (default: data.lake_uri of the config)")
    mo.add_argument("--config")
    mo.add_argument("--policy")
    mo.add_argument("--dry-run", action="store_true", help="decide and record windows, but apply no revert")
    mo.set_defaults(fn=cmd_monitor)
    for stage_parser in sub.choices.values():
        # Also accepted after the stage name. SUPPRESS: when it is not given there, the stage parser
        # sets nothing, so a --verbose given before the stage name is not reset to False.
        stage_parser.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # a usage error exits 2 here, with argparse's message
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return run_stage(args)
    except KeyboardInterrupt:
        print(f"interrupted in {args.stage}", file=sys.stderr)
        return 130
    except Exception as exc:  # the last resort: whoever runs the CLI gets one line, not a traceback
        if args.verbose:
            traceback.print_exception(exc, file=sys.stderr)
        print(f"error in {args.stage}: {one_line(exc)}", file=sys.stderr)
        return 3


def run_stage(args) -> int:
    """The stage's exit code; an error raised on purpose (pipelines.errors) becomes its own code and
    lines, anything else propagates to main."""
    try:
        return args.fn(args)
    except DataValidationError as exc:
        if getattr(args, "report_dir", None):
            print(f"report: {args.report_dir}/report.html", file=sys.stderr)
        for f in exc.failures:
            print(f"FAILED {f['check']}: {f.get('observed')} vs {f.get('expected')}", file=sys.stderr)
        return 1
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    except PipelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def one_line(exc: BaseException) -> str:
    """`Type: message` on a single line (messages of HTTP and SQL errors span several)."""
    message = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
