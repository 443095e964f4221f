"""benchmarks/serve_medians.py: repeated serve sweeps reduce to one median per point,
with its ratio to the baseline's median and every run's figure beside it."""

from __future__ import annotations

import pytest

from tests.conftest import benchmark_module


def _run(tok_s: dict[str, float], latency_ms: float = 500.0) -> dict:
    return {"results": {config: [{"workload": "tasks", "rate": float("inf"), "committed_tok_s": value,
                                  "mean_e2el_ms": latency_ms}] for config, value in tok_s.items()}}


def test_median_of_each_point_and_its_ratio_to_the_baseline_median():
    medians = benchmark_module("serve_medians")
    runs = [_run({"base": 100, "fast": 300}, 400), _run({"base": 200, "fast": 150}, 900),
            _run({"base": 120, "fast": 180}, 600)]
    rows = medians.medians_table(runs, "base").splitlines()[2:]
    assert rows == ["| tasks | inf | base | 100 / 200 / 120 | 120 | 1.00 | 0.60 |",
                    "| tasks | inf | fast | 300 / 150 / 180 | 180 | 1.50 | 0.60 |"]


def test_a_point_missing_from_one_run_is_refused_by_name():
    medians = benchmark_module("serve_medians")
    runs = [_run({"base": 100, "fast": 300}), _run({"base": 200})]
    with pytest.raises(ValueError, match="under fast: 1 of 2 runs"):
        medians.medians_table(runs, "base")
