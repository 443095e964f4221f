"""benchmarks/step_memory.py's pure parts: the peak of live tensor bytes from the
profiler's allocation events, and the longest Refresh a budget allows."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import benchmark_module

step_memory = benchmark_module("step_memory")
MIB = 1 << 20


def test_peak_bytes_counts_what_is_live_together():
    def step():
        a = torch.empty(MIB, dtype=torch.float32)  # 4 MiB
        b = torch.empty(2 * MIB, dtype=torch.float32)  # 8 MiB, beside a
        del a, b
        c = torch.empty(MIB // 2, dtype=torch.float32)  # 2 MiB, after both are freed
        return c

    assert step_memory.peak_bytes(step) == 12 * MIB


def test_peak_bytes_is_above_what_was_live_before():
    held = torch.empty(4 * MIB, dtype=torch.float32)
    assert step_memory.peak_bytes(lambda: held + held) == 16 * MIB  # the sum only


def test_largest_refresh_within_a_budget():
    points = [(1024, 100), (2048, 200), (4096, 300), (8192, 500)]
    assert step_memory.largest_within(points, 150) == pytest.approx(1536)  # between measured points
    assert step_memory.largest_within(points, 400) == pytest.approx(6144)
    # Past the longest: along the slope of the two longest (200 per 4096 tokens).
    assert step_memory.largest_within(points, 600) == pytest.approx(8192 + 2048)
    assert step_memory.fit(points) == pytest.approx((100, 200 / 4096))
