"""Logprobs of generated tokens: each token's log-probability (and the top entries
and its rank) under the model's logits at the step that committed it, against the
oracles' logits at their committing step (tests/oracle.py, tests/oracle_llada2.py),
for LLaDA (blocks, sampling, CFG, a cached parallel rule), Dream (whose token at j
comes from the row at j - 1) and LLaDA2 (2.0, and 2.1 whose edits rewrite a token's
row), batched with requests that ask for none.

Tolerance: plugin and oracle logits agree to ~1e-5 in float32 (O(10) values); a
log-softmax keeps that scale, so 2e-4 leaves a tenfold margin.  Top entries are
compared where the oracle's ranking is not within that tolerance of a tie.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from vllm import SamplingParams

from tests import oracle, oracle_dream, oracle_model, oracle_rules
from tests.conftest import close_engine, make_engine, random_prompt
from tests.oracle_llada2 import llada2_generate, load_llada2_oracle
from tests.tie_free import compare_until

TOLERANCE = 2e-4


def check_rows(name: str, tokens: list[int], entries: list[dict], logits: dict[int, torch.Tensor], k: int) -> float:
    """Each token's entry (vLLM's {token: Logprob}) against log-softmax(logits[i]);
    returns the sum of the tokens' logprobs."""
    total = 0.0
    for i, (token, entry) in enumerate(zip(tokens, entries)):
        want = torch.log_softmax(logits[i].double(), dim=-1)
        got = entry[token]
        assert abs(got.logprob - float(want[token])) < TOLERANCE, (name, i, got.logprob, float(want[token]))
        higher = int((want > want[token] + TOLERANCE).sum())
        close = int(((want - want[token]).abs() <= TOLERANCE).sum())
        assert higher + 1 <= got.rank <= higher + close, (name, i, got.rank, higher, close)
        assert len(entry) <= k + 1, (name, i, len(entry))
        values, ids = want.topk(k + 1)
        for j in range(k):
            if values[j] - values[j + 1] > TOLERANCE and (j == 0 or values[j - 1] - values[j] > TOLERANCE):
                assert int(ids[j]) in entry, (name, i, j)
                assert abs(entry[int(ids[j])].logprob - float(values[j])) < TOLERANCE, (name, i, j)
        total += got.logprob
    return total


def check_logprobs(name: str, completion, commit_logits: dict[int, torch.Tensor], k: int) -> None:
    tokens = list(completion.token_ids)
    assert completion.logprobs is not None and len(completion.logprobs) == len(tokens), name
    total = check_rows(name, tokens, completion.logprobs, commit_logits, k)
    assert abs(completion.cumulative_logprob - total) < 1e-3, name

def llada_ids(model_dir: str) -> dict:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    from transformers import AutoTokenizer

    vocab = AutoTokenizer.from_pretrained(model_dir).get_vocab()
    return {"mask": config["mask_token_id"], "eos": config["eos_token_id"], "eot": vocab.get("<|eot_id|>")}


def compare_with_oracle(llm, cases, rng, reference, extra_request=None) -> int:
    """One draw: every case batched (with `extra_request`, a (prompt, params) pair
    that asks for no logprobs), each tie-free one checked against
    `reference(case, prompt, commit_logits) -> (tokens, ties, result)`.  Returns how
    many were compared."""
    prompts = [random_prompt(rng, case[1]) for case in cases]
    params = [SamplingParams(max_tokens=n, temperature=t, seed=seed, extra_args=dict(extra), logprobs=k)
              for _, _, n, extra, t, seed, k in cases]
    requests = [*zip(prompts, params), *([extra_request] if extra_request else [])]
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in requests], [q for _, q in requests], use_tqdm=False)
    compared = 0
    for case, prompt, out in zip(cases, prompts, outs):
        commit_logits: dict[int, torch.Tensor] = {}
        tokens, ties, _ = reference(case, prompt, commit_logits)
        if ties:
            continue
        assert list(out.outputs[0].token_ids) == tokens, case[0]
        check_logprobs(case[0], out.outputs[0], commit_logits, case[6])
        compared += 1
    if extra_request:
        # A request that asks for no logprobs gets none, and the same tokens as alone.
        assert outs[-1].outputs[0].logprobs is None
        alone = llm.generate([{"prompt_token_ids": extra_request[0]}], [extra_request[1]], use_tqdm=False)[0]
        assert list(alone.outputs[0].token_ids) == list(outs[-1].outputs[0].token_ids)
    return compared


def serve(tiny_dirs, arch: str):
    model_dir = tiny_dirs(arch)
    llm = make_engine(model_dir)
    yield model_dir, llm
    close_engine(llm)


LLADA_CASES = [
    # (name, prompt length, max_tokens, extra_args, temperature, seed, logprobs)
    ("blocks of 8, greedy", 7, 16, {"block_length": 8, "steps": 16}, 0.0, 0, 3),
    ("sampled", 5, 16, {"block_length": 8, "steps": 8}, 0.8, 4, 0),
    ("classifier-free guidance", 6, 16, {"block_length": 16, "steps": 16, "cfg_scale": 1.5}, 0.0, 0, 2),
    ("threshold rule over the dual cache", 9, 16,
     {"block_length": 8, "steps": 16, "decoding": "threshold", "threshold": 0.3, "cache": "dual"}, 0.0, 0, 5),
]


@pytest.fixture(scope="module")
def llada(tiny_dirs):
    yield from serve(tiny_dirs, "llada")


def test_llada_logprobs_are_the_committing_steps(llada):
    model_dir, llm = llada
    ids = llada_ids(model_dir)
    model = oracle_model.load_oracle(model_dir)
    rng = random.Random(5)
    plain = SamplingParams(max_tokens=16, temperature=0.0, extra_args={"block_length": 8, "steps": 16})

    def reference(case, prompt, commit_logits):
        _, _, n, extra, t, seed, _ = case
        extra = {"block_length": n, "cfg_scale": 0.0, **extra}
        want = oracle.llada_generate(
            model, prompt, gen_length=n, steps=extra.pop("steps"), block_length=extra.pop("block_length"),
            temperature=t, cfg_scale=extra.pop("cfg_scale"), mask_id=ids["mask"], eos_id=ids["eos"],
            eot_id=ids["eot"], seed=seed, commit_logits=commit_logits, **extra,
        )
        return oracle_rules.trim_at_eos(want.tokens, ids["eos"]), want.ties, want

    compare_until(len(LLADA_CASES), lambda draw: compare_with_oracle(
        llm, LLADA_CASES, rng, reference, extra_request=(random_prompt(rng, 8), plain)))


DREAM_CASES = [
    ("maskgit_plus, greedy", 8, 16, {"alg": "maskgit_plus", "steps": 16}, 0.0, 0, 3),
    ("origin, sampled", 5, 16, {"steps": 16}, 0.9, 6, 1),
    ("blocks of 8 over the dual cache", 7, 16, {"alg": "topk_margin", "steps": 16, "block_length": 8,
                                                "cache": "dual"}, 0.0, 0, 2),
]


@pytest.fixture(scope="module")
def dream(tiny_dirs):
    yield from serve(tiny_dirs, "dream")


def test_dream_logprobs_come_from_the_row_before(dream):
    model_dir, llm = dream
    ids = llada_ids(model_dir)
    model = oracle_model.load_oracle(model_dir)
    rng = random.Random(7)

    def reference(case, prompt, commit_logits):
        _, _, n, extra, t, seed, _ = case
        extra = dict(extra)
        want = oracle_dream.dream_generate(model, prompt, max_new_tokens=n, steps=extra.pop("steps"), temperature=t,
                                     mask_id=ids["mask"], seed=seed, commit_logits=commit_logits, **extra)
        return oracle_rules.trim_at_eos(want.tokens, ids["eos"]), want.ties, want

    compare_until(len(DREAM_CASES), lambda draw: compare_with_oracle(llm, DREAM_CASES, rng, reference))


@pytest.mark.parametrize("arch", ["llada", "dream"])
def test_prompt_logprobs_follow_the_chain_rule(arch, llada, dream):
    """Position j's logprob is the model's prediction of it with positions j and
    after masked (row j; Dream: row j - 1), whatever else the batch holds."""
    model_dir, llm = llada if arch == "llada" else dream
    ids = llada_ids(model_dir)
    model = oracle_model.load_oracle(model_dir)
    rng = random.Random(13)
    prompts = [random_prompt(rng, n) for n in (2, 9, 14)]
    params = [SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=k,
                             extra_args={"steps": 4, "block_length": 4}) for k in (0, 2, 3)]
    plain = SamplingParams(max_tokens=8, temperature=0.0, extra_args={"steps": 8, "block_length": 8})
    outs = llm.generate([{"prompt_token_ids": p} for p in [*prompts, prompts[1]]], [*params, plain], use_tqdm=False)
    assert outs[-1].prompt_logprobs is None
    for prompt, param, out in zip(prompts, params, outs):
        got = out.prompt_logprobs
        assert len(got) == len(prompt) and got[0] is None
        chain = {}
        for j in range(1, len(prompt)):
            x = torch.tensor([prompt[:j] + [ids["mask"]] * (len(prompt) - j)])
            chain[j - 1] = model.forward(x)[0, j - 1 if arch == "dream" else j]
        check_rows(f"{arch} prompt of {len(prompt)}", prompt[1:], got[1:], chain, param.prompt_logprobs)


def test_prompt_logprobs_beyond_the_step_budget_are_refused(llada):
    model_dir, llm = llada
    # A 120-token prompt's 119 copies are 14280 query tokens: over the engine's budget.
    params = SamplingParams(max_tokens=4, prompt_logprobs=1, extra_args={"steps": 4, "block_length": 4})
    out = llm.generate([{"prompt_token_ids": random_prompt(random.Random(1), 120)}], [params], use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "error"
    assert "prompt_logprobs of a 120-token prompt run 119 masked copies of it (14280 tokens)" in out.outputs[0].stop_reason


# The prompt-logprob tests above run before the LLaDA2 engine starts: vLLM validates
# requests with the defaults of the last engine built in the process (a server has one).
LLADA2_CASES = [
    ("2.0, threshold 0.5", 9, 16, {"block_length": 8, "steps": 8, "threshold": 0.5}, 0.0, 0, 3),
    ("2.1 quality: edits rewrite a token's row", 13, 16, {"block_length": 8, "threshold": 0.7,
                                                          "editing_threshold": 0.5}, 0.0, 0, 2),
    ("2.0 sampled", 6, 16, {"block_length": 8, "steps": 8}, 0.7, 3, 1),
]


@pytest.fixture(scope="module")
def llada2(tiny_dirs):
    yield from serve(tiny_dirs, "llada2")


def test_llada2_logprobs_are_the_last_writing_steps(llada2):
    model_dir, llm = llada2
    ids = json.loads((Path(model_dir) / "generation_config.json").read_text())
    model = load_llada2_oracle(model_dir)
    rng = random.Random(9)
    edited = 0

    def reference(case, prompt, commit_logits):
        nonlocal edited
        _, _, n, extra, t, seed, _ = case
        want = llada2_generate(model, prompt, gen_length=n, mask_id=ids["mask_token_id"],
                               eos_id=ids["eos_token_id"], temperature=t, seed=seed,
                               commit_logits=commit_logits, **extra)
        if not want.ties:
            edited += want.edits
        return want.tokens, want.ties, want

    compare_until(2 * len(LLADA2_CASES), lambda draw: compare_with_oracle(llm, LLADA2_CASES, rng, reference))
    assert edited > 0  # the 2.1 case's rows did come from edits

def test_logprob_steps_cost_the_same_ops_for_any_number_of_requests():
    from tests.test_step_engine import llada, llada2, make_engine as make_step_engine
    from vllm_dllm.engine.op_count import OpCounter

    for options, kind in ((llada(cache="dual"), "llada"), (llada2(), "llada2")):
        counts = {}
        for requests in (1, 4, 16):
            engine = make_step_engine(kind=kind)
            ids = []
            # The same prompts throughout: whether a step streams tokens (and so copies
            # logprob rows) depends on the tokens, not on how many requests run.
            for i in range(requests):
                engine.add(f"r{i}", [3 + j % 50 for j in range(13)], options, seed=0,
                           block_ids=list(range(1 + 8 * i, 9 + 8 * i)), logprobs=2)
                engine.add(f"plain{i}", [4 + j % 50 for j in range(13)], options, seed=0,
                           block_ids=list(range(300 + 8 * i, 308 + 8 * i)))
                ids += [f"r{i}", f"plain{i}"]
            engine.step(ids)  # the first step also settles lazy initialisation
            steps = []
            for _ in range(6):
                with OpCounter() as counter:
                    out = engine.step(ids)
                rows = sum(len(t) for t, r in zip(out.new_tokens, ids) if r.startswith("r"))
                assert (out.logprobs is None and rows == 0) or len(out.logprobs[2]) == rows
                steps.append((counter.total, counter.syncs, rows > 0))
            counts[requests] = steps
        assert counts[1] == counts[4] == counts[16], (kind, counts)
        assert any(copied for _, _, copied in counts[1]), kind  # some measured steps copied logprob rows
