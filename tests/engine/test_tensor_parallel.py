"""Tensor parallelism on this machine's vLLM CPU build: `tensor_parallel_size=2` serves
LLaDA, Dream and LLaDA2 (MoE) with the oracle's tokens, batched, for exact decoding,
the caches (dual, prefix, sparse), parallel rules, CFG, seeded sampling, IterSmooth
(each rank's share of the expected embedding, summed), Dream's filters and LLaDA2.1's
editing.  The sparse cache where a KV head is split off whole
(LLaDA's tiny: two KV heads, one per rank) and refused where it would be replicated
(Dream's tiny: one KV head for two ranks).

Each rank is one worker process with its share of the attention heads, KV heads (one
KV head each, or the model's one replicated), MLP and experts; the scheduler runs
once.  vLLM binds each CPU rank's threads to a NUMA node of its own unless told which
cores to use: on a one-node machine `VLLM_CPU_OMP_THREADS_BIND` gives each rank its
cores ("0|1" on two), as for any model served by vLLM on CPU.  Shards sum in another
order than one device's GEMMs, so near-ties could flip; exact ties are drawn again
(tests/tie_free.py) as in every oracle test.

The LM head is vocabulary-parallel (decoding/vocab.py): each rank reduces its own
vocabulary columns, so the logprobs, prompt logprobs, ELBO and grammar masks run
through the shards too, and are checked here against the same oracles and
tolerances as on one rank (tests/engine/test_logprobs.py, tests/engine/test_structured_outputs.py).
"""

from __future__ import annotations

import os
import random

import pytest

from tests import oracle_model
from tests.conftest import close_engine, make_engine, random_prompt
from tests.engine.test_structured_outputs import ENGINE_STRUCTURED, grammar_kit  # noqa: F401 (a fixture)
from tests.tie_free import compare_each_case

TP = 2


def thread_binding() -> str:
    """The usable CPUs split into one contiguous list per rank."""
    cpus = sorted(os.sched_getaffinity(0))
    assert len(cpus) >= TP, f"tensor parallelism on CPU needs a core per rank, {len(cpus)} usable"
    share = len(cpus) // TP
    return "|".join(",".join(map(str, cpus[r * share:(r + 1) * share])) for r in range(TP))


@pytest.fixture(scope="module", params=["llada", "dream", "llada2"])
def served(request, tiny_dirs):
    arch = request.param
    model_dir = tiny_dirs(arch)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_CPU_OMP_THREADS_BIND", thread_binding())
        # A 20-row LM-head tile: every Refresh also runs its FFN (dense, or shared
        # experts) in chunks, each rank over its share of the FFN width.
        llm = make_engine(model_dir, tensor_parallel_size=TP, additional_config={"dllm": {"max_num_logits": 20}},
                          **ENGINE_STRUCTURED)
    yield arch, model_dir, llm
    close_engine(llm)


def test_both_ranks_chunk_their_ffn_alike(served):
    from tests.engine.test_exact_decoding import _ffn_chunk_rows

    _, _, llm = served
    per_rank = llm.collective_rpc(_ffn_chunk_rows)
    assert len(per_rank) == TP and per_rank[0] and all(rows == per_rank[0] for rows in per_rank)
    assert min(per_rank[0]) < 16  # the dense FFN chunks every Refresh (LLaDA2's narrower shared experts: fewer)


def _llada_cases():
    from tests.engine.test_exact_decoding import LLADA_CASES

    names = {"semi-AR blocks", "seeded gumbel", "classifier-free guidance", "threshold, dual cache",
             "entropy bound over a two-per-step floor, prefix cache", "sparse, per head, retention 0.5",
             "sparse, uniform with mean scoring (Sparse-dLLM), retention 0.3, pool 5, CFG",
             "IterSmooth, threshold, dual cache, weight 0.5"}
    return [c for c in LLADA_CASES if c.name in names]


def _dream_cases():
    from tests.engine.test_exact_decoding import DREAM_CASES

    names = {"maskgit_plus", "entropy sampled with top_p", "maskgit_plus sampled with top_k", "dual cache",
             "prefix cache, refresh every 3, threshold"}
    return [c for c in DREAM_CASES if c.name in names]


def test_two_ranks_decode_as_the_oracle(served):
    arch, model_dir, llm = served
    if arch == "llada2":
        return _compare_llada2(model_dir, llm)
    from tests.engine.test_exact_decoding import _special, oracle_tokens

    cases = _llada_cases() if arch == "llada" else _dream_cases()
    assert len(cases) >= 5
    for case in cases:
        case.seed = case.seed or 0
    ids = _special(model_dir)
    model = oracle_model.load_oracle(model_dir)

    def compare_draw(draw: int, pending):
        rng = random.Random(77 + draw)
        prompts = [random_prompt(rng, case.prompt_len) for case in pending]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [c.params() for c in pending], use_tqdm=False)
        tied = []
        for case, prompt, out in zip(pending, prompts, outs):
            want, ties = oracle_tokens(model, ids, arch, prompt, case)
            if ties:
                tied.append(case)
            else:
                assert list(out.outputs[0].token_ids) == want, f"{case.name}: TP={TP} differs from the oracle"
        return tied

    compare_each_case(cases, compare_draw)


def _compare_llada2(model_dir, llm):
    import json
    from pathlib import Path

    from tests.oracle_llada2 import load_llada2_oracle
    from tests.engine.test_llada2_decoding import CASES, reference

    cases = [c for c in CASES if c.name.startswith(("2.0, one past", "2.1, quality", "2.1, speed", "2.0 sampled",
                                                     "2.0, IterSmooth"))]
    assert len(cases) == 5
    ids = json.loads((Path(model_dir) / "generation_config.json").read_text())
    oracle = load_llada2_oracle(model_dir)

    def compare_draw(draw: int, pending):
        rng = random.Random(91 + draw)
        prompts = [random_prompt(rng, case.prompt_len) for case in pending]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [c.params() for c in pending], use_tqdm=False)
        tied = []
        for case, prompt, out in zip(pending, prompts, outs):
            want = reference(oracle, ids, case, prompt)
            if want.ties:
                tied.append(case)
            else:
                assert list(out.outputs[0].token_ids) == want.tokens, f"{case.name}: TP={TP} differs from the oracle"
        return tied

    compare_each_case(cases, compare_draw)


def test_sparse_kv_is_refused_where_kv_heads_are_replicated(served):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    arch, _, llm = served
    if arch != "dream":
        return  # LLaDA's sparse case decodes as the oracle above; LLaDA2 has no cache policy
    params = SamplingParams(max_tokens=16, extra_args={"steps": 16, "block_length": 8, "cache": "sparse"})
    with pytest.raises((ValueError, VLLMValidationError), match="sparse KV cache is not supported with --tensor-parallel-size 2 on a model "
                                         "with 1 KV head"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], [params], use_tqdm=False)
    # ignore_eos: a random checkpoint may emit EOS early, and that depends on the CPU's numerics.
    ok = SamplingParams(max_tokens=16, ignore_eos=True, extra_args={"steps": 16, "block_length": 8, "cache": "dual"})
    assert len(llm.generate([{"prompt_token_ids": [5, 6, 7]}], [ok], use_tqdm=False)[0].outputs[0].token_ids) == 16


def test_the_sparse_refusal_depends_on_kv_heads_per_rank():
    from types import SimpleNamespace

    from vllm_dllm.serving.server_config import _sparse_refusal

    def config(tp: int, kv_heads: int):
        return SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=tp),
                               model_config=SimpleNamespace(get_total_num_kv_heads=lambda: kv_heads))

    assert _sparse_refusal(config(1, 1)) is None
    assert _sparse_refusal(config(2, 2)) is None  # one whole KV head per rank
    assert _sparse_refusal(config(8, 4)) == (
        "the sparse KV cache is not supported with --tensor-parallel-size 8 on a model with 4 KV head(s): each KV "
        "head is replicated on ranks holding different query heads, which would keep different positions; use "
        "cache 'dual', or a tensor-parallel size of at most 4"
    )


def test_two_ranks_give_the_oracles_logprobs(served):
    from tests.engine import test_logprobs as checks

    arch, model_dir, llm = served
    if arch == "llada2":
        checks.check_llada2_logprobs((model_dir, llm))
        checks.check_block_causal_chain_rule((model_dir, llm), 4)
        return
    (checks.check_llada_logprobs if arch == "llada" else checks.check_dream_logprobs)((model_dir, llm))
    checks.check_chain_rule(arch, (model_dir, llm))


def test_two_ranks_score_the_elbo_as_the_recipe(served):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    from tests.engine.test_logprobs import check_elbo_against_the_recipe

    arch, model_dir, llm = served
    if arch == "llada2":  # no published recipe: refused on every rank count
        params = SamplingParams(max_tokens=4, extra_args={"likelihood": "elbo", "context_tokens": 2})
        with pytest.raises(VLLMValidationError, match=r"block-diffusion \(LLaDA2\) models have none"):
            llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], [params], use_tqdm=False)
        return
    case = (arch, 9, 4, 16, 8, {"cfg_scale": 1.0} if arch == "llada" else {})
    check_elbo_against_the_recipe(case, (model_dir, llm))


def test_two_ranks_follow_the_grammar(served, grammar_kit):
    from tests.engine import test_structured_outputs as checks

    arch, model_dir, llm = served
    if arch == "llada":
        checks.check_constrained_loop(llm, grammar_kit)
        return
    modes = checks.DREAM_MODES if arch == "dream" else checks.LLADA2_MODES
    checks.check_all_parse(llm, modes, [0.0, 0.7], random.Random(12))


def test_a_ranks_columns_drop_its_padding_and_honour_head_dtype():
    """worker/vocab_parallel.shard_logits: the shard's real vocabulary columns only
    (vLLM pads each shard's rows), projected in vLLM's head_dtype when one is set."""
    from types import SimpleNamespace

    import torch

    from vllm_dllm.worker.vocab_parallel import shard_logits

    weight = torch.randn(8, 4, dtype=torch.bfloat16)  # 5 real rows, 3 padding
    head = SimpleNamespace(weight=weight, shard_indices=SimpleNamespace(num_org_elements=5),
                           quant_method=SimpleNamespace(apply=lambda layer, x, bias=None: x @ layer.weight.T))
    hidden = torch.randn(3, 4, dtype=torch.bfloat16)
    plain = shard_logits(head, None, hidden)
    assert plain.shape == (3, 5) and plain.dtype == torch.bfloat16
    wide = shard_logits(head, torch.float32, hidden)
    assert wide.dtype == torch.float32
    torch.testing.assert_close(wide, hidden.float() @ weight[:5].float().T)
