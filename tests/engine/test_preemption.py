"""Under priority scheduling a higher-priority request takes the KV of a running
lower-priority one; the preempted request resumes later and produces exactly the
tokens it would have produced alone, with or without KV reuse."""

from __future__ import annotations

import random

import pytest
from vllm import SamplingParams

from tests import oracle, oracle_model, oracle_rules
from tests.conftest import close_engine, make_engine, random_prompt
from tests.engine.test_exact_decoding import _special, cache_arguments


@pytest.mark.parametrize("cache", ["none", "dual", "sparse"])
def test_preempted_request_resumes_and_matches_unpreempted(tiny_dirs, cache):
    model_dir = tiny_dirs("llada")
    # One 128-token CPU block per request and a pool of two blocks, one of which is
    # vLLM's null block: exactly one request holds KV at a time.
    # Calls of two denoising steps: a call ends mid-block, where the newcomer preempts.
    llm = make_engine(model_dir, scheduling_policy="priority", max_model_len=128, kv_cache_memory_bytes=2 * 262144,
                      additional_config={"dllm": {"max_steps_per_call": 2}})
    model, ids = oracle_model.load_oracle(model_dir), _special(model_dir)
    # With the dual cache, IterSmooth as well: the rebuilt block-start Refresh had no
    # smoothing to repeat.
    variants = [{}, {"iter_smooth": True}] if cache == "dual" else [{}]
    try:
        for variant in variants:
            _preempt_and_compare(llm, model, ids, {"cache": cache, **variant})
    finally:
        close_engine(llm)


def _preempt_and_compare(llm, model, ids, options: dict) -> None:
    engine = llm.llm_engine
    rng = random.Random(11)
    low_prompt, high_prompt = random_prompt(rng, 12), random_prompt(rng, 7)
    low = SamplingParams(max_tokens=32, temperature=0.0, extra_args={"steps": 32, "block_length": 8, **options})
    high = SamplingParams(max_tokens=16, temperature=0.0, extra_args={"steps": 16, "block_length": 8, **options})
    finished_order, outputs = [], {}
    engine.add_request("low", {"prompt_token_ids": low_prompt}, low, priority=5)
    streamed = 0
    for _ in range(6):  # "low" runs 12 of its 32 steps, streaming its first block
        for out in engine.step():
            streamed = len(out.outputs[0].token_ids)
    assert 0 < streamed < 32
    engine.add_request("high", {"prompt_token_ids": high_prompt}, high, priority=0)
    for _ in range(500):
        for out in engine.step():
            if out.finished:
                finished_order.append(out.request_id)
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        if not engine.has_unfinished_requests():
            break
    assert finished_order == ["high", "low"], options
    cache = options["cache"]
    # With KV reuse, "low" was preempted mid-block: its resumed step rebuilt the cache
    # from its last Refresh's canvas, so it still decodes exactly as if never preempted.
    for name, prompt, gen in [("low", low_prompt, 32), ("high", high_prompt, 16)]:
        result = oracle.llada_generate(
            model, prompt, gen_length=gen, steps=gen, block_length=8, cache=cache, **cache_arguments({"cache": cache}, set()),
            mask_id=ids["mask"], eos_id=ids["eos"], eot_id=ids["eot"], iter_smooth=options.get("iter_smooth", False),
        )
        assert outputs[name] == oracle_rules.trim_at_eos(result.tokens, ids["eos"]), options
