"""Requests that do not fit the token budget, the sequence cap or the KV pool wait
and then complete exactly; a request ends at its first final EOS."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load_file, save_file
from vllm import SamplingParams

from tests import oracle, oracle_model, oracle_rules
from tests.conftest import close_engine, make_engine, random_prompt
from tests.engine.test_exact_decoding import _special
from vllm_dllm.tools.make_tiny import make_tiny


def llada_oracle(model, ids, prompt, gen, steps, block):
    result = oracle.llada_generate(
        model, prompt, gen_length=gen, steps=steps, block_length=block,
        mask_id=ids["mask"], eos_id=ids["eos"], eot_id=ids["eot"],
    )
    return oracle_rules.trim_at_eos(result.tokens, ids["eos"]), result.ties


def test_requests_beyond_budget_and_kv_pool_wait_and_complete_exactly(tiny_dirs):
    model_dir = tiny_dirs("llada")
    # CPU block size is 128 tokens; one block per request here.  The pool holds 4
    # blocks (one is vLLM's null block): at most 3 requests hold KV at once, and the
    # 128-token budget fits at most 2 of these 48-token sequences per step.
    llm = make_engine(
        model_dir, max_model_len=128, max_num_batched_tokens=128, max_num_seqs=3, kv_cache_memory_bytes=1 << 20
    )
    rng = random.Random(7)
    prompts = [random_prompt(rng, 16 + i) for i in range(8)]
    params = SamplingParams(max_tokens=32, temperature=0.0, extra_args={"steps": 32, "block_length": 8})
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert llm.llm_engine.get_num_unfinished_requests() == 0
    finally:
        close_engine(llm)
    model, ids = oracle_model.load_oracle(model_dir), _special(model_dir)
    for prompt, out in zip(prompts, outs):
        want, ties = llada_oracle(model, ids, prompt, 32, 32, 8)
        assert ties or list(out.outputs[0].token_ids) == want


@pytest.fixture(scope="module")
def eos_prone_model(tmp_path_factory):
    """A tiny LLaDA whose LM head predicts EOS wherever it used to predict one
    common token, so EOS shows up mid-canvas."""
    model_dir = make_tiny("llada", tmp_path_factory.mktemp("eos") / "llada", seed=7)
    ids = _special(str(model_dir))
    canvas = torch.tensor([random_prompt(random.Random(0), 8) + [ids["mask"]] * 32])
    predicted = oracle_model.load_oracle(str(model_dir)).forward(canvas)[0, 8:].argmax(dim=-1)
    common = int(torch.bincount(predicted).argmax())
    weights = load_file(model_dir / "model.safetensors")
    head = weights["model.transformer.ff_out.weight"]
    head[ids["eos"]] = head[common] * 1.3
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    return str(model_dir)


def test_request_ends_at_first_final_eos(eos_prone_model):
    rng = random.Random(3)
    prompts = [random_prompt(rng, n) for n in (4, 9, 15, 22)]
    params = SamplingParams(max_tokens=32, temperature=0.0, extra_args={"steps": 32, "block_length": 8})
    llm = make_engine(eos_prone_model)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        close_engine(llm)
    model, ids = oracle_model.load_oracle(eos_prone_model), _special(eos_prone_model)
    ended_early = 0
    for prompt, out in zip(prompts, outs):
        got = list(out.outputs[0].token_ids)
        want, ties = llada_oracle(model, ids, prompt, 32, 32, 8)
        assert ties or got == want
        if len(got) < 32:
            assert got[-1] == ids["eos"] and ids["eos"] not in got[:-1]
            assert out.outputs[0].finish_reason == "stop"
            ended_early += 1
    assert ended_early >= 1
