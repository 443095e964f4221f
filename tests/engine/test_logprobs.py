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
import math
import random
from pathlib import Path

import numpy as np
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
    check_llada_logprobs(llada)


def check_llada_logprobs(served) -> None:
    model_dir, llm = served
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


def official_elbo(model, prompt: list[int], context: int, recipe: str, masked: torch.Tensor, mask_id: int,
                  eos_id: int, dream_p: torch.Tensor | None = None, cfg: float = 0.0) -> tuple[float, list[float]]:
    """eval_llada.py's `get_loglikelihood` / Dream's `_eval_target_nll_mc`, given the
    samples' masks (and Dream's per-sample masking probabilities): per sample the
    masked tokens' cross-entropy / p_mask (LLaDA: l / L), negated; LLaDA's guidance
    masks the context of an unconditional copy; Dream scores the prompt followed by
    EOS (its `_encode_pair`) and its logits are shifted (position j read from row j - 1)."""
    length = len(prompt) - context
    sequence = prompt + [eos_id] if recipe == "dream" else prompt
    values = []
    for i, row in enumerate(masked):
        seq = torch.tensor([sequence])
        noisy = torch.where(row[None], mask_id, seq)
        logits = model.forward(noisy)[0]
        if cfg > 0:
            un = noisy.clone()
            un[0, :context] = mask_id
            un_logits = model.forward(un)[0]
            logits = un_logits + (cfg + 1) * (logits - un_logits)
        if recipe == "dream":
            logits = torch.cat([logits[:1], logits[:-1]])
        where = row.nonzero()[:, 0]
        p_mask = row.sum().item() / length if recipe == "llada" else dream_p[i].item()
        ce = torch.nn.functional.cross_entropy(logits[where].double(), seq[0, where], reduction="none")
        values.append(-(ce / p_mask).sum().item())
    return sum(values) / len(values), values


def check_elbo_against_the_recipe(case, served) -> None:
    """The estimate equals eval_llada.py's / Dream's formula evaluated by the oracle
    on the masks the request drew, batched beside requests that ask for other things."""
    from vllm_dllm.decoding.elbo import draw_samples, estimate

    arch, length, context, samples, batch, options = case
    model_dir, llm = served
    ids = llada_ids(model_dir)
    model = oracle_model.load_oracle(model_dir)
    rng = random.Random(length * 31 + context)
    prompt = random_prompt(rng, length)
    xargs = {"steps": 4, "block_length": 4, "likelihood": "elbo", "context_tokens": context,
             "mc_samples": samples, "mc_batch": batch, **options}
    params = SamplingParams(max_tokens=4, temperature=0.0, seed=21, extra_args=xargs)
    beside = [SamplingParams(max_tokens=8, temperature=0.0, extra_args={"steps": 8, "block_length": 8}),
              SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=1,
                             extra_args={"steps": 4, "block_length": 4})]
    outs = llm.generate([{"prompt_token_ids": p} for p in (prompt, random_prompt(rng, 5), random_prompt(rng, 6))],
                        [params, *beside], use_tqdm=False)
    got = outs[0].kv_transfer_params["likelihood"]
    assert all(out.kv_transfer_params is None for out in outs[1:])
    draw = draw_samples(arch, 21, length + (arch == "dream"), context, samples, batch)
    want, values = official_elbo(model, prompt, context, arch, draw.masked, ids["mask"], ids["eos"],
                                 dream_p=1 / draw.weight, cfg=options.get("cfg_scale", 0.0))
    assert got["loglikelihood"] == pytest.approx(want, abs=2e-4 * max(1.0, abs(want)))
    assert got["standard_error"] == pytest.approx(estimate(values)[1], abs=2e-4 * max(1.0, abs(want)))
    assert {k: got[k] for k in ("estimator", "mc_samples", "mc_batch", "context_tokens", "continuation_tokens")} == {
        "estimator": "elbo", "mc_samples": samples, "mc_batch": batch, "context_tokens": context,
        "continuation_tokens": length - context}
    if length - context == 1 and arch == "llada":
        # One token, always masked with weight 1: the exact log p(x | context).
        assert got["standard_error"] == pytest.approx(0.0, abs=1e-6)


def exact_expectations(model, prompt: list[int], context: int, mask_id: int, eos_id: int,
                       shift: bool) -> dict[str, float]:
    """The estimators' expected values, by enumerating every mask of the continuation.

    LLaDA: the count l is uniform on 1..L (each sample's stratified count is, over
    the batch's k, when mc_batch divides L) and the set uniform among those of size
    l: E = sum_l (1/L)(L/l) mean_{|M|=l} S(M).  Dream: every position but the last
    masked with probability p = eps + (1 - eps) t, t uniform, in the prompt followed by
    EOS: E = int p^(|M|-1) (1 - p)^(L-|M|) S(M) dt summed over sets, S(M) the masked
    log-probabilities."""
    from itertools import combinations

    from vllm_dllm.decoding.elbo import DREAM_EPS

    length = len(prompt) - context
    seq = torch.tensor([prompt + [eos_id]] if shift else [prompt])

    def masked_logprob(positions) -> float:
        row = torch.zeros(seq.shape[1], dtype=torch.bool)
        row[list(positions)] = True
        logits = model.forward(torch.where(row[None], mask_id, seq))[0].double()
        if shift:
            logits = torch.cat([logits[:1], logits[:-1]])
        logp = logits.log_softmax(-1)
        return sum(logp[j, prompt[j]].item() for j in positions)

    continuation = range(context, len(prompt))
    llada = sum((1 / length) * (length / size) * sum(masked_logprob(m) for m in combinations(continuation, size))
                / math.comb(length, size) for size in range(1, length + 1))
    scorable = [j for j in continuation if j != 0]  # the appended EOS is never masked
    p = np.linspace(DREAM_EPS, 1.0, 200001)
    dream = 0.0
    for size in range(1, len(scorable) + 1):
        weight = np.trapezoid(p ** (size - 1) * (1 - p) ** (len(scorable) - size), p) / (1 - DREAM_EPS)
        dream += weight * sum(masked_logprob(m) for m in combinations(scorable, size))
    return {"llada": llada, "dream": dream}


def check_elbo_centres_on_its_expectation(arch: str, served) -> None:
    """Unbiased with an honest error: over seeds, the estimates scatter around the
    estimator's exact expectation as their standard errors say."""
    model_dir, llm = served
    ids = llada_ids(model_dir)
    model = oracle_model.load_oracle(model_dir)
    prompt = random_prompt(random.Random(5), 7)
    context = 3  # L = 4
    exact = exact_expectations(model, prompt, context, ids["mask"], ids["eos"], shift=arch == "dream")[arch]
    seeds = list(range(12))
    params = [SamplingParams(max_tokens=4, temperature=0.0, seed=seed,
                             extra_args={"steps": 4, "block_length": 4, "likelihood": "elbo",
                                         "context_tokens": context, "mc_samples": 64, "mc_batch": 4})
              for seed in seeds]
    outs = llm.generate([{"prompt_token_ids": prompt}] * len(seeds), params, use_tqdm=False)
    got = [out.kv_transfer_params["likelihood"] for out in outs]
    values = np.array([g["loglikelihood"] for g in got])
    errors = np.array([g["standard_error"] for g in got])
    assert (errors > 0).all()
    # Each estimate within 4 of its errors; their mean within 4 errors of the mean.
    assert (np.abs(values - exact) < 4 * errors).all(), (values, errors, exact)
    assert abs(values.mean() - exact) < 4 * np.sqrt((errors**2).sum()) / len(seeds)
    # The same seed draws the same masks alone as batched with the others; only the
    # GEMMs' row counts differ (float32 rounding, ~1e-6 of the value).
    alone = llm.generate([{"prompt_token_ids": prompt}], [params[3]], use_tqdm=False)[0].kv_transfer_params
    assert alone["likelihood"]["loglikelihood"] == pytest.approx(got[3]["loglikelihood"], rel=1e-5)
    assert alone["likelihood"]["standard_error"] == pytest.approx(got[3]["standard_error"], rel=1e-4)


LLADA_ELBO_CASES = [
    # (arch, prompt length, context tokens, mc_samples, mc_batch, extra options)
    ("llada", 9, 4, 16, 8, {}),
    ("llada", 7, 6, 4, 4, {}),  # one continuation token: every sample masks it, weight 1
    ("llada", 8, 3, 8, 8, {"cfg_scale": 1.5}),
]


@pytest.mark.parametrize("case", LLADA_ELBO_CASES, ids=["plain", "one-token", "cfg"])
def test_llada_elbo_is_the_official_recipe_on_the_same_masks(case, llada):
    check_elbo_against_the_recipe(case, llada)


def test_llada_elbo_centres_on_its_expectation_within_its_error(llada):
    check_elbo_centres_on_its_expectation("llada", llada)


@pytest.fixture(scope="module")
def dream(tiny_dirs):
    yield from serve(tiny_dirs, "dream")


def test_dream_logprobs_come_from_the_row_before(dream):
    check_dream_logprobs(dream)


def check_dream_logprobs(served) -> None:
    model_dir, llm = served
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


def test_dream_elbo_is_the_official_recipe_on_the_same_masks(dream):
    check_elbo_against_the_recipe(("dream", 10, 3, 16, 8, {}), dream)


def test_dream_elbo_centres_on_its_expectation_within_its_error(dream):
    check_elbo_centres_on_its_expectation("dream", dream)


@pytest.mark.parametrize("arch", ["llada", "dream"])
def test_prompt_logprobs_follow_the_chain_rule(arch, llada, dream):
    check_chain_rule(arch, llada if arch == "llada" else dream)


def check_chain_rule(arch: str, served) -> None:
    """Position j's logprob is the model's prediction of it with positions j and
    after masked (row j; Dream: row j - 1), whatever else the batch holds."""
    model_dir, llm = served
    ids = llada_ids(model_dir)
    model = oracle_model.load_oracle(model_dir)
    rng = random.Random(13)
    prompts = [random_prompt(rng, n) for n in (2, 9, 14)]
    params = [SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=k,
                             extra_args={"steps": 4, "block_length": 4}) for k in (0, 2, 3)]
    plain = SamplingParams(max_tokens=8, temperature=0.0, extra_args={"steps": 8, "block_length": 8})

    def predict(prompt, j):
        x = torch.tensor([prompt[:j] + [ids["mask"]] * (len(prompt) - j)])
        return model.forward(x)[0, j - 1 if arch == "dream" else j]

    check_prompt_logprobs(llm, arch, prompts, params, plain, predict)


def check_prompt_logprobs(llm, name: str, prompts, params, plain, predict) -> None:
    """Requests asking for prompt logprobs, batched beside one that asks for none:
    position j's entries are those of `predict(prompt, j)`, the oracle's logits row."""
    outs = llm.generate([{"prompt_token_ids": p} for p in [*prompts, prompts[-1]]], [*params, plain], use_tqdm=False)
    assert outs[-1].prompt_logprobs is None
    for prompt, param, out in zip(prompts, params, outs):
        got = out.prompt_logprobs
        assert len(got) == len(prompt) and got[0] is None
        chain = {j - 1: predict(prompt, j) for j in range(1, len(prompt))}
        check_rows(f"{name} prompt of {len(prompt)}", prompt[1:], got[1:], chain, param.prompt_logprobs)


def test_prompt_copies_are_priced_at_their_query_tokens():
    from vllm_dllm.engine.prompt_scoring import scoring_tokens

    for length in range(0, 40):
        assert scoring_tokens([length])[0] == length * max(length - 1, 0)
        for block in (1, 3, 4, 32):
            # Copy j (j = 1..P-1) runs to the end of j's block.
            want = sum((j // block + 1) * block for j in range(1, length))
            assert scoring_tokens([length], block)[0] == want, (length, block)


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
    check_llada2_logprobs(llada2)


def check_llada2_logprobs(served) -> None:
    model_dir, llm = served
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


@pytest.mark.parametrize("block_length", [4, 8])
def test_llada2_prompt_logprobs_follow_the_block_causal_chain_rule(llada2, block_length):
    check_block_causal_chain_rule(llada2, block_length)


def check_block_causal_chain_rule(served, block_length: int) -> None:
    """Position j's logprob is LLaDA2's prediction of it with positions j and after
    masked, read block-causally as it generates: j's block (padded with masks past
    the prompt) over the blocks before."""
    from tests.oracle_llada2 import block_causal_mask

    model_dir, llm = served
    oracle = load_llada2_oracle(model_dir)
    mask_id = json.loads((Path(model_dir) / "generation_config.json").read_text())["mask_token_id"]
    rng = random.Random(29 + block_length)
    prompts = [random_prompt(rng, n) for n in (2, 7, 11)]
    xargs = {"block_length": block_length, "steps": block_length}
    params = [SamplingParams(max_tokens=block_length, temperature=0.0, prompt_logprobs=k, extra_args=xargs)
              for k in (0, 2, 1)]
    plain = SamplingParams(max_tokens=block_length, temperature=0.0, extra_args=xargs)

    def predict(prompt, j):
        end = (j // block_length + 1) * block_length
        x = torch.tensor(prompt[:j] + [mask_id] * (end - j))
        return oracle.forward(x, block_causal_mask(end, block_length))[j]

    check_prompt_logprobs(llm, f"llada2, blocks of {block_length},", prompts, params, plain, predict)


def test_logprob_steps_cost_the_same_ops_for_any_number_of_requests():
    from tests.unit.test_step_engine import llada, llada2, make_engine as make_step_engine
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


def test_prompt_logprobs_of_a_one_token_prompt_leave_the_engine(llada):
    """A one-token prompt has no position to score: its prompt logprobs are [None]
    (vLLM's answer), and the engine core must still send them to the front end.  Its
    empty arrays once carried a zero stride that vLLM's serialiser cannot view as bytes:
    the engine core's output thread died and every request hung.  Last in this module,
    with a deadline, so a regression fails here instead of hanging the rest."""
    import threading

    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from vllm_dllm.worker.runner import prompt_logprobs_tensors

    empty = (np.zeros((0, 3), np.int64), np.zeros((0, 3), np.float32), np.zeros(0, np.int64))
    for tensor, array in zip(prompt_logprobs_tensors(empty), empty):
        back = MsgpackDecoder(torch.Tensor).decode(MsgpackEncoder().encode(tensor))
        assert back.shape == array.shape and back.dtype == torch.from_numpy(array).dtype
    rows = (np.arange(6).reshape(2, 3), np.ones((2, 3), np.float32), np.array([1, 2]))
    for tensor, array in zip(prompt_logprobs_tensors(rows), rows):
        assert np.array_equal(tensor.numpy(), array)

    _, llm = llada
    params = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=2, extra_args={"steps": 4})
    answer: dict = {}
    worker = threading.Thread(
        target=lambda: answer.update(outs=llm.generate([{"prompt_token_ids": [7]}], params, use_tqdm=False)),
        daemon=True,
    )
    worker.start()
    worker.join(timeout=300)
    assert "outs" in answer, "no answer in 300 s to a one-token prompt asking for prompt logprobs"
    out = answer["outs"][0]
    assert out.prompt_logprobs == [None]
    assert len(out.outputs[0].token_ids) == 4
