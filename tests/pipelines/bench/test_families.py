"""bench families: one slot-day adapter of each family trained as the backtest trains it, served through the
trusted registry pyfunc; the figures are measured, named and plausible (their values: docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from pipelines.bench import families


@pytest.mark.slow
def test_quick_run_measures_every_family_through_the_registry_pyfunc():
    out = families.run(quick=True)
    assert set(out["families"]) == {"feature_transformer", "dcn", "minilm_text"} == set(families.CONFIGS)
    assert out["threads"] == 1 and out["quick"] is True
    for name, r in out["families"].items():
        assert r["adapter_rows"] > 0 and r["adapter_cpu_s"] > 0, name
        assert r["adapter_bytes"] > 1000, name
        assert 0 < r["pyfunc_p50_ms"] <= r["pyfunc_p99_ms"], name
    # the transformer reads 40 tokens a row where the tabular families read 9 ids
    text, default = out["families"]["minilm_text"], out["families"]["feature_transformer"]
    assert text["pyfunc_p50_ms"] > default["pyfunc_p50_ms"]
