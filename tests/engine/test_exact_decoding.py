"""In exact mode the plugin reproduces the reference decoding loops token for token.

Every case runs through vLLM's `LLM` with the plugin, and through the independent
plain-PyTorch oracle (tests/oracle.py, tests/oracle_dream.py); both in float32.  All cases of a model are
served concurrently in one batch and again one by one: the outputs must not depend
on what else is in the batch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from vllm import SamplingParams

from tests import oracle, oracle_dream, oracle_model, oracle_rules
from tests.conftest import close_engine, make_engine, random_prompt
from tests.tie_free import compare_each_case


@dataclass
class Case:
    name: str
    prompt_len: int
    gen_length: int
    extra: dict = field(default_factory=dict)
    temperature: float = 0.0
    seed: int | None = None
    top_p: float = 1.0
    top_k: int = 0

    def params(self) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.gen_length,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            extra_args=dict(self.extra),
        )


LLADA_CASES = [
    Case("semi-AR blocks", 5, 32, {"block_length": 8, "steps": 32}),
    Case("one block, two tokens per step", 11, 32, {"block_length": 32, "steps": 16}),
    Case("random remasking", 7, 16, {"block_length": 8, "steps": 8, "remasking": "random"}, seed=3),
    Case("seeded gumbel", 9, 24, {"block_length": 8, "steps": 12}, temperature=0.8, seed=11),
    Case("classifier-free guidance", 6, 16, {"steps": 16, "cfg_scale": 1.5}),
    Case("logits_eos_inf", 4, 16, {"steps": 16, "logits_eos_inf": True}),
    Case("confidence_eos_eot_inf", 13, 16, {"block_length": 8, "steps": 16, "confidence_eos_eot_inf": True}),
    Case("confidence_eos_eot_inf at T>0", 3, 16, {"steps": 8, "confidence_eos_eot_inf": True}, temperature=0.5, seed=5),
    # Parallel decoding (blocks end when they have no masks; the tiny model's top
    # probabilities lie around 0.29-0.32 and its entropies around 2.8 nats, so these
    # parameters commit a varying number per step).
    Case("threshold (Fast-dLLM)", 6, 32, {"block_length": 8, "steps": 32, "decoding": "threshold", "threshold": 0.3}),
    Case("threshold, dual cache", 7, 32,
         {"block_length": 8, "steps": 32, "decoding": "threshold", "threshold": 0.3, "cache": "dual"}),
    Case("factor, dual cache", 5, 32, {"block_length": 8, "steps": 32, "decoding": "factor", "factor": 1.9, "cache": "dual"}),
    Case("entropy bound over a two-per-step floor, prefix cache", 8, 32,
         {"block_length": 16, "steps": 16, "decoding": "entropy_bound", "gamma": 8.0, "cache": "prefix"}),
    Case("hierarchy (dInfer), dual cache", 9, 32, {"block_length": 16, "steps": 32, "decoding": "hierarchy",
                                                   "threshold": 0.4, "low_threshold": 0.3, "cache": "dual"}),
    Case("credit (dInfer), seeded at T>0", 4, 32, {"block_length": 8, "steps": 32, "decoding": "credit",
                                                    "threshold": 0.5, "credit_alpha": 0.7}, temperature=0.5, seed=8),
    # Sparse KV (delay_step 1 by default): per-head and shared selections, wider
    # pooling, a CFG twin with its own selection, parallel decoding on top.
    Case("sparse, per head, retention 0.5", 9, 32, {"block_length": 8, "steps": 32, "cache": "sparse",
                                                     "retention": 0.5}),
    Case("sparse, uniform with mean scoring (Sparse-dLLM), retention 0.3, pool 5, CFG", 6, 16,
         {"block_length": 8, "steps": 16, "cache": "sparse", "retention": 0.3, "selection": "uniform",
          "scoring": "mean", "pool_kernel": 5, "cfg_scale": 1.5}),
    Case("sparse, retention 0.2, threshold, refresh every 3", 12, 32,
         {"block_length": 16, "steps": 32, "cache": "sparse", "retention": 0.2, "refresh_interval": 3,
          "decoding": "threshold", "threshold": 0.3}),
    # IterSmooth (dInfer): each masked position's expected embedding fed back, and
    # under a threshold rule the threshold falling from 1.
    Case("IterSmooth, semi-AR blocks", 7, 32, {"block_length": 8, "steps": 32, "iter_smooth": True}),
    Case("IterSmooth, threshold, dual cache, weight 0.5", 8, 32,
         {"block_length": 8, "steps": 32, "decoding": "threshold", "threshold": 0.3, "cache": "dual",
          "iter_smooth": True, "smooth_weight": 0.5}),
    Case("IterSmooth, hierarchy, threshold falling by 0.05", 11, 32,
         {"block_length": 16, "steps": 32, "decoding": "hierarchy", "threshold": 0.4, "low_threshold": 0.3,
          "iter_smooth": True, "smooth_threshold_decay": 0.05}),
    Case("IterSmooth, CFG, prefix cache", 5, 16,
         {"block_length": 8, "steps": 16, "cfg_scale": 1.5, "cache": "prefix", "iter_smooth": True}),
    Case("IterSmooth, seeded gumbel, vicinity cache", 10, 16,
         {"block_length": 8, "steps": 16, "cache": "vicinity", "vicinity": 3, "iter_smooth": True},
         temperature=0.8, seed=13),
]

BLOCK_KEYS = ("block_length", "refresh_interval", "delay_step")
SPARSE_DEFAULTS = {"retention": 0.5, "selection": "head"}


def cache_arguments(extra: dict, passed: set) -> dict:
    """The oracle's sparse cache arguments for a case, the plugin's defaults written
    out (its one-step delayed update too, unless `passed` already holds delay_step)."""
    if extra.get("cache") != "sparse":
        return {}
    arguments = {"sparse": {key: extra.get(key, default) for key, default in SPARSE_DEFAULTS.items()}}
    # Unless told, the plugin pools uniform selection's scores, and head-centric
    # selection's from retention 0.4 on, and scores head-centric selection by attention
    # weights.
    uniform = arguments["sparse"]["selection"] == "uniform"
    pooled = uniform or arguments["sparse"]["retention"] >= 0.4
    arguments["sparse"]["pool_kernel"] = extra.get("pool_kernel", 3 if pooled else 1)
    arguments["sparse"]["scoring"] = extra.get("scoring", "max" if uniform else "weight")
    if not ("delay_step" in passed and "delay_step" in extra):
        arguments["delay_step"] = 1
    return arguments
PARALLEL_KEYS = ("cache", "decoding", "threshold", "factor", "gamma", "low_threshold", "max_tokens_per_step",
                 "credit_alpha", "credit_decay", "credit_boost")
LLADA_ONLY_KEYS = ("vicinity", "iter_smooth", "smooth_weight", "smooth_threshold_decay")

DREAM_CASES = [
    Case("origin", 5, 24, {"steps": 24}, seed=1),
    Case("maskgit_plus", 8, 16, {"alg": "maskgit_plus", "steps": 16}),
    Case("topk_margin, fewer steps", 6, 16, {"alg": "topk_margin", "steps": 8}),
    Case("entropy", 10, 32, {"alg": "entropy", "steps": 32}),
    Case("entropy sampled with top_p", 7, 16, {"alg": "entropy", "steps": 16}, temperature=0.7, seed=4, top_p=0.9),
    Case("maskgit_plus sampled with top_k", 4, 16, {"alg": "maskgit_plus", "steps": 16}, temperature=1.0, seed=9, top_k=20),
    Case("alg_temp selection", 9, 16, {"alg": "maskgit_plus", "steps": 16, "alg_temp": 0.5}, seed=2),
    Case("origin sampled", 12, 16, {"steps": 16}, temperature=0.9, seed=6),
    # Parallel decoding (the tiny model: threshold 0.5 takes ~20 of 24 steps; gamma 20
    # lifts an 8-step schedule's floor of 3 per step to whole-canvas commits).
    Case("threshold over maskgit_plus", 6, 24, {"alg": "maskgit_plus", "steps": 24, "decoding": "threshold",
                                                "threshold": 0.5}),
    Case("entropy bound over a schedule of 8 steps", 9, 24, {"alg": "topk_margin", "steps": 8,
                                                             "decoding": "entropy_bound", "gamma": 20.0}),
    Case("credit over maskgit_plus", 5, 24, {"alg": "maskgit_plus", "steps": 24, "decoding": "credit",
                                             "threshold": 0.7}),
    # Blocks and KV reuse: Dream's rule within each block; a Reuse also runs the
    # position before the block (its row predicts the block's first position).
    Case("blocks of 8", 6, 24, {"alg": "maskgit_plus", "steps": 24, "block_length": 8}),
    Case("dual cache", 7, 24, {"alg": "topk_margin", "steps": 24, "block_length": 8, "cache": "dual"}),
    Case("prefix cache, refresh every 3, threshold", 5, 24,
         {"alg": "maskgit_plus", "steps": 24, "block_length": 8, "cache": "prefix", "refresh_interval": 3,
          "decoding": "threshold", "threshold": 0.5}),
    Case("dual cache, origin sampled, delayed fill", 8, 24,
         {"steps": 12, "block_length": 8, "cache": "dual", "delay_step": 1}, temperature=0.8, seed=3),
    Case("sparse cache, per head", 7, 24, {"alg": "maskgit_plus", "steps": 24, "block_length": 8, "cache": "sparse",
                                           "retention": 0.4}),
    Case("sparse cache, uniform, pool 1, no delay", 10, 24,
         {"alg": "entropy", "steps": 24, "block_length": 8, "cache": "sparse", "retention": 0.3,
          "selection": "uniform", "pool_kernel": 1, "delay_step": 0}),
]


def oracle_tokens(model, tokenizer_ids, arch: str, prompt: list[int], case: Case):
    if arch == "llada":
        extra = {"block_length": case.gen_length, "remasking": "low_confidence", "cfg_scale": 0.0, **case.extra}
        result = oracle.llada_generate(
            model,
            prompt,
            gen_length=case.gen_length,
            steps=extra.get("steps", case.gen_length),
            block_length=extra["block_length"],
            temperature=case.temperature,
            cfg_scale=extra["cfg_scale"],
            remasking=extra["remasking"],
            mask_id=tokenizer_ids["mask"],
            eos_id=tokenizer_ids["eos"],
            eot_id=tokenizer_ids["eot"],
            logits_eos_inf=extra.get("logits_eos_inf", False),
            confidence_eos_eot_inf=extra.get("confidence_eos_eot_inf", False),
            seed=case.seed or 0,
            **{key: extra[key] for key in (*PARALLEL_KEYS, *LLADA_ONLY_KEYS, "refresh_interval", "delay_step")
               if key in extra},
            **cache_arguments(extra, {"refresh_interval", "delay_step"}),
        )
    else:
        result = oracle_dream.dream_generate(
            model,
            prompt,
            max_new_tokens=case.gen_length,
            steps=case.extra.get("steps", case.gen_length),
            alg=case.extra.get("alg", "origin"),
            alg_temp=case.extra.get("alg_temp"),
            temperature=case.temperature,
            top_p=case.top_p if case.top_p < 1 else None,
            top_k=case.top_k if case.top_k > 0 else None,
            mask_id=tokenizer_ids["mask"],
            seed=case.seed or 0,
            **{key: case.extra[key] for key in (*PARALLEL_KEYS, *BLOCK_KEYS) if key in case.extra},
            **cache_arguments(case.extra, set(BLOCK_KEYS)),
        )
    return oracle_rules.trim_at_eos(result.tokens, tokenizer_ids["eos"]), result.ties


def _special(model_dir: str) -> dict:
    from transformers import AutoTokenizer

    from vllm_dllm.families import register_hf_classes

    register_hf_classes()
    import json
    import pathlib

    config = json.loads((pathlib.Path(model_dir) / "config.json").read_text())
    vocab = AutoTokenizer.from_pretrained(model_dir).get_vocab()
    return {"mask": config["mask_token_id"], "eos": config["eos_token_id"], "eot": vocab.get("<|eot_id|>")}


# A small LM-head tile: 20 rows of the tiny vocabulary (320), whose 25,600 bytes also
# bound the FFN (3 x 256 float32 intermediate per token): 8 tokens per FFN chunk, so
# every Refresh runs its FFN in chunks (models/token_chunks.py).
MAX_NUM_LOGITS = 20
FFN_CHUNK_ROWS = 8


@pytest.fixture(scope="module", params=["llada", "dream"])
def served(request, tiny_dirs):
    arch = request.param
    model_dir = tiny_dirs(arch)
    llm = make_engine(model_dir, additional_config={"dllm": {"max_num_logits": MAX_NUM_LOGITS}})
    yield arch, model_dir, llm
    close_engine(llm)


def _ffn_chunk_rows(worker) -> list:
    return [m.max_rows for m in worker.model_runner.model.modules() if hasattr(m, "limit_activation")]


def test_refresh_steps_run_their_ffn_in_chunks(served):
    _, _, llm = served
    (rows,) = llm.collective_rpc(_ffn_chunk_rows)
    assert rows and set(rows) == {FFN_CHUNK_ROWS}  # every layer; under any case's prompt + canvas


def test_exact_mode_matches_oracle_and_is_batch_invariant(served):
    arch, model_dir, llm = served
    cases = LLADA_CASES if arch == "llada" else DREAM_CASES
    # Unseeded deterministic cases must still be seeded on both sides for the oracle.
    for case in cases:
        if case.seed is None:
            case.seed = 0
    ids = _special(model_dir)
    model = oracle_model.load_oracle(model_dir)

    def compare_draw(draw: int, pending: list[Case]) -> list[Case]:
        rng = random.Random(1234 + draw)
        prompts = [random_prompt(rng, case.prompt_len) for case in pending]
        batched = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], [c.params() for c in pending], use_tqdm=False
        )
        alone = [
            llm.generate([{"prompt_token_ids": p}], [c.params()], use_tqdm=False)[0]
            for p, c in zip(prompts, pending)
        ]
        tied = []
        for case, prompt, out_batched, out_alone in zip(pending, prompts, batched, alone):
            got = list(out_batched.outputs[0].token_ids)
            assert got == list(out_alone.outputs[0].token_ids), f"{case.name}: batching changed the output"
            want, ties = oracle_tokens(model, ids, arch, prompt, case)
            if ties:
                tied.append(case)  # either side of an exact tie is right: draw this case again
            else:
                assert got == want, f"{case.name}: plugin {got} != oracle {want}"
        return tied

    compare_each_case(cases, compare_draw)


def test_iter_smooth_changes_what_is_decoded(served):
    """The fed-back embeddings reach the model: with them the tokens differ from
    plain decoding on some prompt (the oracle comparison above holds either way)."""
    arch, _, llm = served
    if arch != "llada":
        return  # an LLaDA-family option (Dream refuses it: tests/unit/test_options_smoothing.py)
    rng = random.Random(8)
    prompts = [{"prompt_token_ids": random_prompt(rng, n)} for n in (5, 9, 14)]
    base = {"block_length": 8, "steps": 32}
    plain = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, extra_args=base), use_tqdm=False)
    smooth = SamplingParams(max_tokens=32, temperature=0.0, extra_args={**base, "iter_smooth": True})
    smoothed = llm.generate(prompts, smooth, use_tqdm=False)
    differ = [a.outputs[0].token_ids != b.outputs[0].token_ids for a, b in zip(plain, smoothed)]
    assert any(differ)


def test_a_plain_request_after_a_smoothing_one_decodes_as_alone(served):
    """A finished smoothing request leaves nothing for the next request in its slot,
    even when that one shares its steps with another smoothing request."""
    arch, _, llm = served
    if arch != "llada":
        return
    rng = random.Random(12)
    base = {"block_length": 8, "steps": 32}
    smooth = SamplingParams(max_tokens=32, temperature=0.0, extra_args={**base, "iter_smooth": True})
    plain = SamplingParams(max_tokens=32, temperature=0.0, extra_args=base)
    differs = 0
    for _ in range(3):
        first, second, other = (random_prompt(rng, n) for n in (6, 9, 7))
        alone = llm.generate([{"prompt_token_ids": second}], plain, use_tqdm=False)[0].outputs[0].token_ids
        llm.generate([{"prompt_token_ids": first}], smooth, use_tqdm=False)  # frees the slot the next one takes
        mixed = llm.generate([{"prompt_token_ids": second}, {"prompt_token_ids": other}], [plain, smooth],
                             use_tqdm=False)
        assert mixed[0].outputs[0].token_ids == alone
        differs += mixed[1].outputs[0].token_ids != llm.generate(
            [{"prompt_token_ids": other}], plain, use_tqdm=False)[0].outputs[0].token_ids
    assert differs  # the smoothing request beside it did smooth
