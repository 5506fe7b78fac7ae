"""Multi-adapter serving with hot swap (issue #5 §3): `AdapterServer` in `router`.

Nothing is imported here: `python -m pipelines` adds the `serve` parser from `serving.cli` on every
run, and importing this package must not load torch (tests/pipelines/test_cli_imports.py)."""
