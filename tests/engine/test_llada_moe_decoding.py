"""LLaDA-MoE through vLLM's engine, decoded as LLaDA: token for token against LLaDA's
reference generate() (tests/oracle.py) running on the LLaDA-MoE oracle forward
(tests/oracle_llada_moe.py), batched, greedy, with LLaDA's options, its Refresh steps'
routed experts in row chunks.  One engine."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from vllm import SamplingParams

from tests import oracle, oracle_rules
from tests.conftest import close_engine, make_engine, random_prompt
from tests.oracle_llada_moe import load_llada_moe_oracle
from tests.tie_free import compare_each_case

# (prompt length, max_tokens, LLaDA options): one block and several, a step per
# token and fewer steps than tokens.
CASES = [
    (5, 16, {"steps": 16, "block_length": 16}),
    (12, 24, {"steps": 12, "block_length": 8, "remasking": "low_confidence"}),
    (20, 16, {"steps": 8, "block_length": 4}),
    (9, 16, {"steps": 16, "block_length": 8, "iter_smooth": True}),
]


@pytest.fixture(scope="module")
def served(tiny_dirs):
    model_dir = tiny_dirs("llada-moe")
    # A 10-row LM-head tile: every Refresh runs its routed experts (and dense layers) in chunks.
    llm = make_engine(model_dir, additional_config={"dllm": {"max_num_logits": 10}})
    yield model_dir, llm
    close_engine(llm)


def _routed_chunk_rows(worker) -> list:
    from vllm_dllm.models.token_chunks import RoutedRows

    return [m.max_rows for m in worker.model_runner.model.modules() if isinstance(m, RoutedRows)]


def test_refresh_steps_run_their_routed_experts_in_chunks(served):
    _, llm = served
    (rows,) = llm.collective_rpc(_routed_chunk_rows)
    # Every MoE layer, well under a Refresh of these cases' prompt and canvas (21-44 tokens).
    assert rows and max(rows) < 21


def test_greedy_decoding_equals_the_llada_reference(served):
    model_dir, llm = served
    ids = json.loads((Path(model_dir) / "generation_config.json").read_text())
    model = load_llada_moe_oracle(model_dir)
    lengths = []

    def compare_draw(draw: int, pending: list[int]) -> list[int]:
        rng = random.Random(17 + draw)
        prompts = [random_prompt(rng, CASES[i][0]) for i in pending]
        params = [SamplingParams(max_tokens=CASES[i][1], temperature=0.0, extra_args=dict(CASES[i][2]))
                  for i in pending]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tied = []
        for i, prompt, out in zip(pending, prompts, outs):
            _, max_tokens, options = CASES[i]
            want = oracle.llada_generate(model, prompt, gen_length=max_tokens, mask_id=ids["mask_token_id"],
                                         eos_id=ids["eos_token_id"], eot_id=-1, **options)
            if want.ties:
                tied.append(i)
                continue
            got = list(out.outputs[0].token_ids)
            assert got == oracle_rules.trim_at_eos(want.tokens, ids["eos_token_id"]), f"case {CASES[i]}"
            lengths.append(len(got))
        return tied

    compare_each_case(list(range(len(CASES))), compare_draw)
    assert max(lengths) > 4, f"outputs too short to tell anything: {lengths}"  # not EOS at once
