"""Shared fixtures: tiny checkpoints generated once per session, engines per module.

An engine start costs tens of seconds on a 2-core CPU, so each test module builds
at most one and its tests share it.
"""

from __future__ import annotations

import gc
import os
import random

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

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


def make_engine(model_dir: str, **overrides):
    from vllm import LLM

    return LLM(model=model_dir, **{**ENGINE_DEFAULTS, **overrides})


def close_engine(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


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
