"""The CUDA worker's KV budget (worker/gpu_worker.py), checked on a CPU with vLLM's
memory profiler replaced by a recorder: what is profiled and the budget's arithmetic,
not the device numbers (no GPU here)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest

from vllm_dllm.worker import gpu_worker
from vllm_dllm.worker.gpu_worker import DiffusionGPUWorker

GIB = 1 << 30
# What vLLM's profiler reports: memory consumed since the instance started (weights
# included) plus the step's transient peak.
NON_KV = 22 * GIB


class FakeRunner:
    model_memory_usage = 16 * GIB

    def __init__(self, events):
        self.events = events

    def profile_step(self):
        self.events.append("profile step")

    def self_check(self):
        self.events.append("self check")


@pytest.fixture
def events(monkeypatch):
    events = []

    @contextlib.contextmanager
    def memory_profiling(baseline, weights_memory=0):
        events.append(("measure", baseline, weights_memory))
        result = SimpleNamespace(non_kv_cache_memory=None)
        yield result
        result.non_kv_cache_memory = NON_KV  # vLLM fills it in after the body
        events.append("measured")

    monkeypatch.setattr(gpu_worker, "memory_profiling", memory_profiling)
    return events


def worker(events, kv_cache_memory_bytes=None, requested=72 * GIB):
    w = DiffusionGPUWorker.__new__(DiffusionGPUWorker)
    w.cache_config = SimpleNamespace(kv_cache_memory_bytes=kv_cache_memory_bytes)
    w.model_runner = FakeRunner(events)
    w.init_snapshot = object()
    w.requested_memory = requested
    return w


def test_the_kv_budget_is_the_requested_share_minus_what_the_profile_measured(events):
    w = worker(events)
    assert w.determine_available_memory() == 72 * GIB - NON_KV
    assert events == [("measure", w.init_snapshot, 16 * GIB), "profile step", "measured"]


def test_kv_cache_memory_is_taken_as_given_after_a_profile_step(events):
    w = worker(events, kv_cache_memory_bytes=5 * GIB)
    assert w.determine_available_memory() == 5 * GIB
    assert events == ["profile step"]  # the caps must still fit; nothing is measured


def test_a_budget_below_zero_is_zero(events):
    assert worker(events, requested=20 * GIB).determine_available_memory() == 0


def test_warm_up_runs_a_step_with_the_pool_bound_then_the_self_check(events, monkeypatch):
    monkeypatch.setattr(gpu_worker.torch.cuda, "synchronize", lambda: events.append("sync"))
    times = worker(events).compile_or_warm_up_model()
    assert events == ["profile step", "sync", "self check"]
    assert times.language_model == 0.0  # nothing is compiled by torch.compile
