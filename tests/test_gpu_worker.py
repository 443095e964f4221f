"""The CUDA worker's KV budget (worker/gpu_worker.py), checked on a CPU with vLLM's
memory profiler replaced by a recorder: the arithmetic and what is profiled, not the
device numbers (no GPU here)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest

from vllm_dllm.worker import gpu_worker
from vllm_dllm.worker.gpu_worker import DiffusionGPUWorker

GIB = 1 << 30


class FakeRunner:
    model_memory_usage = 16 * GIB

    def __init__(self):
        self.profiled = 0

    def profile_step(self):
        self.profiled += 1


def worker(kv_cache_memory_bytes=None, requested=72 * GIB):
    w = DiffusionGPUWorker.__new__(DiffusionGPUWorker)
    w.cache_config = SimpleNamespace(kv_cache_memory_bytes=kv_cache_memory_bytes)
    w.model_runner = FakeRunner()
    w.init_snapshot = object()
    w.requested_memory = requested
    return w


@pytest.fixture
def profiler(monkeypatch):
    calls = []

    @contextlib.contextmanager
    def memory_profiling(baseline, weights_memory=0):
        result = SimpleNamespace(non_kv_cache_memory=weights_memory + 6 * GIB)  # weights + a 6 GiB peak
        calls.append((baseline, weights_memory))
        yield result

    monkeypatch.setattr(gpu_worker, "memory_profiling", memory_profiling)
    return calls


def test_the_kv_budget_is_the_requested_share_minus_weights_and_step_peak(profiler):
    w = worker()
    assert w.determine_available_memory() == (72 - 16 - 6) * GIB
    assert profiler == [(w.init_snapshot, 16 * GIB)]
    assert w.model_runner.profiled == 1


def test_kv_cache_memory_is_taken_as_given_after_a_profile_step(profiler):
    w = worker(kv_cache_memory_bytes=5 * GIB)
    assert w.determine_available_memory() == 5 * GIB
    assert profiler == []
    assert w.model_runner.profiled == 1  # the caps must still fit


def test_a_budget_below_zero_is_zero(profiler):
    assert worker(requested=20 * GIB).determine_available_memory() == 0
