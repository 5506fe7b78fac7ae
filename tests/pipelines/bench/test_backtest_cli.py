"""`python -m pipelines backtest`'s modes: an option a mode does not read is refused, not ignored."""

import pytest

from pipelines.__main__ import build_parser, main
from pipelines.bench.backtest_cli import check_mode
from pipelines.errors import ConfigError


def _args(*argv: str):
    return build_parser().parse_args(["backtest", *argv])


@pytest.mark.parametrize(
    "argv, refusal",
    [
        (("--cold-items", "5", "--mlflow"), r"--cold-items: it does not read --mlflow"),
        (("--cold-items", "5", "--only", "static", "--quick"), r"--cold-items: it does not read --only, --quick"),
        (("--few-shot", "10", "--scores", "f.parquet"), r"--few-shot: it does not read --scores"),
        (("--choose", "ranks", "--report", "out"), r"--choose: it does not read --report"),
        (("--few-shot", "10", "--cold-items", "5"), r"--few-shot and --cold-items are separate modes"),
        (("--val-days", "3"), r"--val-days is an option of --choose"),
        (("--cut", "validation"), r"--cut is an option of --few-shot"),
        (("--cold-items", "5", "--cut", "test"), r"--cold-items: it does not read --cut"),
    ],
)
def test_an_option_the_mode_does_not_read_is_refused(argv, refusal):
    with pytest.raises(ConfigError, match=refusal):
        check_mode(_args(*argv))


@pytest.mark.parametrize(
    "argv",
    [
        (),
        ("--quick", "--only", "static", "--report", "out", "--mlflow", "--scores", "f.parquet"),
        (
            "--cold-items",
            "5",
            "--from",
            "1998-01-20",
            "--to",
            "1998-03-06",
            "--days",
            "3",
            "--base-cache",
            "d",
            "--scores",
            "f.parquet",
            "--json",
            "--config",
            "c.yaml",
        ),
        ("--choose", "schedule", "--only", "a", "--val-days", "1", "--days", "2", "--base-cache", "d"),
        ("--few-shot", "10", "--json"),
        ("--few-shot", "10", "--cut", "validation", "--json"),
    ],
)
def test_each_mode_takes_the_options_it_reads(argv):
    check_mode(_args(*argv))


def test_the_cli_exits_2_naming_the_option_before_reading_any_data(capsys):
    assert main(["backtest", "--cold-items", "5", "--report", "out"]) == 2
    assert "does not read --report" in capsys.readouterr().err
