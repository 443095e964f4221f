"""Shared fixtures: tiny checkpoints generated once per session, engines per module.

Offline engines run their engine core inside the test process: the scheduler, the
worker and the runner are the plugin's either way, and a start costs ~3 s there
instead of ~20 s for a process that imports torch and vLLM again.  vLLM's
multiprocess path is what every `vllm serve` test runs (server_utils.py drops the
setting) and what the tensor-parallel tests run (one process per rank).  vLLM's
parallel groups are process-wide and an in-process core tears them down when it
shuts down, so an engine made while another in-process one is alive gets a process
of its own.
"""

from __future__ import annotations

import gc
import logging
import os
import random
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
os.environ.setdefault(MULTIPROCESSING_ENV, "0")

from vllm_dllm.log import PARENT as PLUGIN_LOG_PARENT  # noqa: E402
from vllm_dllm.tools.make_tiny import make_tiny  # noqa: E402

ENGINE_DEFAULTS = dict(
    dtype="float32",
    max_model_len=256,
    max_num_seqs=8,
    kv_cache_memory_bytes=96 << 20,
    enforce_eager=True,
    gpu_memory_utilization=0.3,
    seed=0,
)


@pytest.fixture
def plugin_logs(caplog):
    """caplog sees the plugin's log lines: they go to vLLM's "vllm" logger
    (vllm_dllm/log.py), which stops records before the root logger, where caplog
    listens, once vLLM has configured logging.  Captured there, once either way."""
    parent = logging.getLogger(PLUGIN_LOG_PARENT)
    propagate = parent.propagate
    parent.addHandler(caplog.handler)
    parent.propagate = False
    try:
        yield
    finally:
        parent.removeHandler(caplog.handler)
        parent.propagate = propagate


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """Lazily made tiny checkpoints: tiny_dirs(arch, vocab) -> path."""
    made: dict[tuple[str, str], str] = {}
    root = tmp_path_factory.mktemp("tiny")

    def get(arch: str, vocab: str = "small") -> str:
        key = (arch, vocab)
        if key not in made:
            made[key] = str(make_tiny(arch, root / f"{arch}-{vocab}", vocab=vocab, seed=7))
        return made[key]

    return get


_in_process_engines: set[int] = set()  # id() of the live LLMs whose core runs here


def _fresh_envs() -> None:
    envs = sys.modules.get("vllm.envs")
    disable = getattr(envs, "disable_envs_cache", None)
    if disable is not None:
        disable()


def make_engine(model_dir: str, **overrides):
    from vllm import LLM

    saved = os.environ.get(MULTIPROCESSING_ENV)
    if _in_process_engines:
        os.environ[MULTIPROCESSING_ENV] = "1"
        _fresh_envs()
    try:
        llm = LLM(model=model_dir, **{**ENGINE_DEFAULTS, **overrides})
    finally:
        if saved is None:
            os.environ.pop(MULTIPROCESSING_ENV, None)
        else:
            os.environ[MULTIPROCESSING_ENV] = saved
        _fresh_envs()
    if type(llm.llm_engine.engine_core).__name__ == "InprocClient":
        _in_process_engines.add(id(llm))
    return llm


def close_engine(llm) -> None:
    _in_process_engines.discard(id(llm))
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


@pytest.fixture(autouse=True)
def _fresh_vllm_environment():
    """An engine core started in this process freezes vLLM's view of the environment
    (vllm.envs caches it once the core is up); each test reads it afresh."""
    yield
    _fresh_envs()


def random_prompt(rng: random.Random, length: int, vocab_low: int = 3, vocab_high: int = 250) -> list[int]:
    """Prompt ids drawn from plain (non-special) tokens of the small vocab."""
    return [rng.randrange(vocab_low, vocab_high) for _ in range(length)]


def benchmark_module(name: str):
    """benchmarks/<name>.py loaded as a module (benchmarks/ is not a package), for the
    tests of its pure parts."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
