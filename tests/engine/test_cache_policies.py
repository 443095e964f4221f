"""KV reuse: the prefix, dual and vicinity cache policies match the oracle's
independent implementation token for token (float32), batched or alone, and the
engine reports the Refresh/Reuse mix it ran."""

from __future__ import annotations

import random

import pytest
from vllm import SamplingParams

from tests import oracle, oracle_model, oracle_rules
from tests.conftest import close_engine, make_engine, random_prompt
from tests.engine.test_exact_decoding import _special

POLICIES = [
    ("none", {}),
    ("prefix", {}),
    ("dual", {}),
    ("dual", {"refresh_interval": 2}),
    ("prefix", {"delay_step": 1}),
    ("dual", {"delay_step": 1, "refresh_interval": 3}),
    ("vicinity", {"vicinity": 3}),
    ("vicinity", {"vicinity": 10, "refresh_interval": 2}),
]


@pytest.fixture(scope="module")
def llada(tiny_dirs):
    model_dir = tiny_dirs("llada")
    llm = make_engine(model_dir)
    yield model_dir, llm
    close_engine(llm)


def test_cache_policies_match_oracle(llada):
    model_dir, llm = llada
    rng = random.Random(21)
    cases = []
    for i, (policy, knobs) in enumerate(POLICIES):
        for cfg in (0.0, 1.0) if policy == "dual" and not knobs else (0.0,):
            extra = {"cache": policy, "steps": 32, "block_length": 8, "cfg_scale": cfg, **knobs}
            cases.append((random_prompt(rng, 5 + 3 * i), extra))
    params = [SamplingParams(max_tokens=32, temperature=0.0, seed=0, extra_args=extra) for _, extra in cases]
    prompts = [{"prompt_token_ids": p} for p, _ in cases]
    batched = llm.generate(prompts, params, use_tqdm=False)
    alone = [llm.generate([p], [sp], use_tqdm=False)[0] for p, sp in zip(prompts, params)]

    model, ids = oracle_model.load_oracle(model_dir), _special(model_dir)
    differs_from_exact = 0
    for (prompt, extra), out_b, out_a in zip(cases, batched, alone):
        got = list(out_b.outputs[0].token_ids)
        assert got == list(out_a.outputs[0].token_ids), f"{extra}: batching changed the output"
        kwargs = dict(
            gen_length=32, steps=32, block_length=8, cfg_scale=extra["cfg_scale"],
            mask_id=ids["mask"], eos_id=ids["eos"], eot_id=ids["eot"],
        )
        result = oracle.llada_generate(
            model, prompt, cache=extra["cache"], refresh_interval=extra.get("refresh_interval", 0),
            delay_step=extra.get("delay_step", 0), vicinity=extra.get("vicinity", 0), **kwargs,
        )
        if result.ties == 0:
            assert got == oracle_rules.trim_at_eos(result.tokens, ids["eos"]), f"{extra}"
        exact = oracle.llada_generate(model, prompt, **kwargs)
        differs_from_exact += oracle_rules.trim_at_eos(exact.tokens, ids["eos"]) != got
    # The caches are stale by design: some outputs must differ from exact decoding,
    # or the test would not be exercising Reuse steps at all.
    assert differs_from_exact >= 1


def test_a_vicinity_covering_the_sequence_decodes_exactly(llada):
    """Its Reuse steps run every position, so nothing stale is read: the tokens of
    exact decoding (cache none), at a Reuse step's price of the whole sequence."""
    _, llm = llada
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": random_prompt(rng, n)} for n in (4, 9, 13)]
    base = {"steps": 32, "block_length": 8}
    exact = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, extra_args={**base, "cache": "none"}),
                         use_tqdm=False)
    whole = SamplingParams(max_tokens=32, temperature=0.0, extra_args={**base, "cache": "vicinity", "vicinity": 64})
    got = llm.generate(prompts, whole, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in got] == [list(o.outputs[0].token_ids) for o in exact]
