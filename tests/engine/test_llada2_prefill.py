"""A block-causal prompt's prefill under the token budget and from vLLM's prefix
cache: long prompts run in chunks of whole blocks (--long-prefill-token-threshold),
and a prompt sharing whole KV blocks with an earlier one starts past them; either way
every output equals the reference's (tests/oracle_llada2.py, no cache, no chunks).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from tests.conftest import random_prompt
from tests.oracle_llada2 import llada2_generate, load_llada2_oracle
from tests.engine.test_llada2_decoding import Case
from tests.tie_free import compare_each_case, compare_until
from lab import eval as task_eval

BLOCK = 8
CHUNK = 3 * BLOCK  # --long-prefill-token-threshold: a prefill step runs at most three blocks
KV_BLOCK = 128  # vLLM's CPU KV block: the unit of prefix cache hits


@pytest.fixture(scope="module")
def served(tiny_dirs):
    model_dir = tiny_dirs("llada2")
    # The engine core in this process: one scheduler step per engine.step().
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        runner = task_eval.OfflineRunner(
            model_dir,
            dict(dtype="float32", max_model_len=512, max_num_seqs=8, kv_cache_memory_bytes=64 << 20,
                 enforce_eager=True, gpu_memory_utilization=0.3, seed=0, enable_prefix_caching=True,
                 long_prefill_token_threshold=CHUNK),
        )
    yield model_dir, runner
    runner.engine.engine_core.shutdown()


def query_tokens(runner) -> float:
    import prometheus_client

    name = "vllm:diffusion_scheduled_query_tokens_per_step_sum"
    return prometheus_client.REGISTRY.get_sample_value(name, runner.labels) or 0.0


def run(runner, prompts, cases) -> tuple[list[list[int]], int]:
    """Outputs of the requests run together, and the forwards they took: an engine
    step runs a prefill chunk, or a call of denoising steps (counted by the metrics)."""
    order = []
    for prompt, case in zip(prompts, cases):
        order.append(f"prefill-{runner._next_id}")
        runner._next_id += 1
        runner.engine.add_request(order[-1], {"prompt_token_ids": prompt}, case.params())
    done, forwards = {}, 0
    while runner.engine.has_unfinished_requests():
        before = runner._steps()
        for out in runner.engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        forwards += max(int(runner._steps() - before), 1)
    return [done[req_id] for req_id in order], forwards


def reference(model_dir, case: Case, prompt: list[int]):
    ids = json.loads((Path(model_dir) / "generation_config.json").read_text())
    return llada2_generate(
        load_llada2_oracle(model_dir), prompt, gen_length=case.max_tokens, mask_id=ids["mask_token_id"],
        eos_id=ids["eos_token_id"], **case.reference_options(),
    )


def prefill_chunks(prompt_len: int, cached: int = 0) -> int:
    """Steps a prefill takes before the one that also denoises: the prompt's whole
    blocks and the first canvas block, from the cached prefix on, CHUNK at a time."""
    first_step = prompt_len - prompt_len % BLOCK + BLOCK - cached
    return math.ceil(first_step / CHUNK) - 1


CHUNKED = [
    Case("2.0, a prompt of five blocks and a bit", 43, 16, {"block_length": BLOCK, "steps": BLOCK}),
    Case("2.0, whole blocks", 64, 16, {"block_length": BLOCK, "steps": 4, "threshold": 0.5}),
    Case("2.1 quality", 57, 16, {"block_length": BLOCK, "mode": "quality", "max_post_steps": 2}),
    Case("2.0, one chunk: no extra step", 13, 16, {"block_length": BLOCK, "steps": BLOCK}),
]


def test_long_prompts_prefill_in_chunks_with_the_same_tokens(served):
    model_dir, runner = served
    chunked = 0

    def compare_draw(draw: int, pending: list[Case]) -> list[Case]:
        nonlocal chunked
        rng = random.Random(100 + draw)
        prompts = [random_prompt(rng, case.prompt_len) for case in pending]
        # Batched with a short request that keeps denoising while the prompts prefill.
        short = Case("short", 5, 24, {"block_length": BLOCK, "steps": BLOCK})
        batched, _ = run(runner, [random_prompt(rng, 5), *prompts], [short, *pending])
        tied = []
        for case, prompt, got in zip(pending, prompts, batched[1:]):
            (alone,), steps = run(runner, [prompt], [case])
            assert alone == got, f"{case.name}: batching changed the output"
            want = reference(model_dir, case, prompt)
            if want.ties:
                tied.append(case)
                continue
            assert got == want.tokens, f"{case.name}: plugin {got} != reference {want.tokens}"
            # The reference's forwards, plus one step per prefill chunk that decodes nothing.
            assert steps == want.forwards_to_output + prefill_chunks(case.prompt_len), case.name
            chunked += prefill_chunks(case.prompt_len) > 0
        return tied

    compare_each_case(CHUNKED, compare_draw)
    assert chunked >= 3


def test_a_shared_prefix_is_prefilled_once_with_the_same_tokens(served):
    """A second prompt sharing its first KV block (128 tokens, sixteen whole blocks)
    with a finished request starts its prefill after it: its steps run 128 query
    tokens fewer than the same prompt without the cache, and it decodes the same."""
    model_dir, runner = served
    case = Case("2.1 quality", 0, 16, {"block_length": BLOCK, "mode": "quality"})
    rng = random.Random(7)

    def compare(draw: int) -> bool:
        shared = random_prompt(rng, KV_BLOCK + 3)
        first, second = shared + random_prompt(rng, 9), shared + random_prompt(rng, 14)
        want = reference(model_dir, case, second)
        if want.ties:
            return False
        runner.engine.reset_prefix_cache()
        before = query_tokens(runner)
        (cold,), cold_steps = run(runner, [second], [case])
        cold_tokens = query_tokens(runner) - before
        runner.engine.reset_prefix_cache()
        run(runner, [first], [case])
        before = query_tokens(runner)
        (warm,), warm_steps = run(runner, [second], [case])
        warm_tokens = query_tokens(runner) - before
        assert cold == warm == want.tokens, f"cold {cold}, warm {warm}, reference {want.tokens}"
        assert cold_tokens - warm_tokens == KV_BLOCK, (cold_tokens, warm_tokens)
        assert cold_steps - warm_steps == prefill_chunks(len(second)) - prefill_chunks(len(second), KV_BLOCK)
        return True

    compare_until(2, compare)


def test_the_next_turn_of_a_chat_finds_the_previous_answer_cached(served):
    """A first turn's prompt (120 tokens) fills no KV block, but its answer's finished
    blocks complete one: the next turn (prompt, answer, a new message) starts after
    those 128 positions and decodes as it does without the cache."""
    model_dir, runner = served
    case = Case("2.0", 0, 40, {"block_length": BLOCK, "steps": BLOCK})
    rng = random.Random(11)

    def compare(draw: int) -> bool:
        first_prompt = random_prompt(rng, 120)
        runner.engine.reset_prefix_cache()
        (answer,), _ = run(runner, [first_prompt], [case])
        if len(answer) < case.max_tokens:  # ended early at EOS: its blocks may not reach 128
            return False
        second = first_prompt + answer + random_prompt(rng, 20)
        want = reference(model_dir, case, second)
        if want.ties:
            return False
        before = query_tokens(runner)
        (warm,), _ = run(runner, [second], [case])
        warm_tokens = query_tokens(runner) - before
        runner.engine.reset_prefix_cache()
        before = query_tokens(runner)
        (cold,), _ = run(runner, [second], [case])
        cold_tokens = query_tokens(runner) - before
        assert cold == warm == want.tokens, f"cold {cold}, warm {warm}, reference {want.tokens}"
        assert cold_tokens - warm_tokens == KV_BLOCK, (cold_tokens, warm_tokens)
        return True

    compare_until(1, compare)


# ---- the pieces, without vLLM --------------------------------------------------


def test_a_chunked_prefill_is_priced_step_by_step():
    from vllm_dllm.options import LLaDA2Options
    from vllm_dllm.scheduler.track import RequestTrack

    options = LLaDA2Options(
        max_tokens=16, block_length=BLOCK, steps=4, threshold=0.95, minimal_topk=1, eos_early_stop=False,
        editing_threshold=None, max_post_steps=16, num_to_transfer=1, temperature=0.0, top_k=None, top_p=None,
    ).placed(43)
    costs = RequestTrack(options, 43, blocks=1, chunk=CHUNK).profile()
    # Prompt blocks [0, 40) and the first canvas block [40, 48): one chunk of three
    # blocks, then the other three blocks with the first denoising step; then the
    # block's three other steps, and the next two blocks' four each (their first
    # with the finished block's K/V); 3 + 16 canvas positions are three blocks.
    assert costs == (24, 24, 8, 8, 8, 16, 8, 8, 8, 16, 8, 8, 8)
    cached = RequestTrack(options, 43, blocks=1, chunk=CHUNK, prefilled=32)
    assert cached.tokens == 16 and cached.profile()[0] == 16


def test_only_final_kv_is_offered_to_the_prefix_cache():
    from vllm_dllm.options import LLaDA2Options
    from vllm_dllm.scheduler.track import RequestTrack

    options = LLaDA2Options(
        max_tokens=40, block_length=BLOCK, steps=4, threshold=0.95, minimal_topk=1, eos_early_stop=False,
        editing_threshold=None, max_post_steps=16, num_to_transfer=1, temperature=0.0, top_k=None, top_p=None,
    ).placed(43)
    track = RequestTrack(options, 43, blocks=1, chunk=CHUNK, prefilled=24)
    assert track.exact_prefix() == 24  # mid-prefill: what the chunks wrote
    track.has_cache = True
    for (block, block_step), exact in [((0, 1), 40), ((1, 0), 40), ((1, 2), 48), ((2, 0), 48), ((3, 1), 64)]:
        # The prompt's whole blocks [0, 40); a canvas block once its successor ran a step.
        track.block, track.block_step = block, block_step
        assert track.exact_prefix() == exact, (block, block_step)


def test_prefill_chunk_steps_cost_the_same_ops_for_any_number_of_requests():
    import numpy as np
    import torch

    from tests.unit.test_step_engine import BLOCK_SIZE, IDS, SHAPE, add_requests, llada2
    from vllm_dllm.attention.backends import TorchAttention
    from vllm_dllm.engine.engine import StepEngine
    from vllm_dllm.engine.op_count import OpCounter
    from vllm_dllm.engine.torch_model import build_model

    counts = {}
    for requests in (1, 4, 16):
        model = build_model(SHAPE, torch.float32, "cpu", seed=0)
        model.allocate_kv_pool(num_blocks=1024, block_size=BLOCK_SIZE, dtype=torch.float32, device="cpu")
        engine = StepEngine(model, kind="llada2", ids=IDS, capacity=64, max_model_len=128, block_size=BLOCK_SIZE,
                            max_num_logits=1024, backend=TorchAttention(), device=torch.device("cpu"),
                            prefill_chunk=16)
        # Prompts of 40 run two chunks of two blocks before their first step; prompts
        # of 13 (a block and the first canvas block) fit one and decode at once.
        long = add_requests(engine, requests, llada2(), prompt_len=40, first_block=1)
        short = [f"s{i}" for i in range(requests)]
        for i, req in enumerate(short):
            engine.add(req, [5 + i] * 13, llada2(), seed=i, block_ids=list(range(600 + 8 * i, 608 + 8 * i)))
        with OpCounter() as only_chunks:
            out = engine.step(long)
        assert out.new_tokens == [[]] * requests and out.logits_rows == 0
        with OpCounter() as mixed:
            out = engine.step(long + short)
        slots = np.array([engine.slots[r] for r in long])
        assert (engine.host.prefilled[slots] == 32).all() and not engine.host.has_cache[slots].any()
        engine.step(long)  # the prefill's last step: [32, 48) with the first denoising step
        assert engine.host.has_cache[slots].all()
        counts[requests] = (only_chunks.total, only_chunks.syncs, mixed.total, mixed.syncs)
    assert counts[1] == counts[4] == counts[16], counts
    assert counts[1][1] == 0 and counts[1][3] == 1, counts


def test_cached_prefixes_must_be_whole_prompt_blocks():
    from tests.unit.test_step_engine import llada2, make_engine

    engine = make_engine(kind="llada2")
    engine.add("ok", [5] * 20, llada2(), seed=0, block_ids=[1, 2, 3], prefilled=16)
    for prefilled in (12, 24):  # not a whole block; past the prompt's whole blocks
        with pytest.raises(ValueError, match="not whole blocks"):
            engine.add(f"bad{prefilled}", [5] * 20, llada2(), seed=0, block_ids=[4, 5, 6], prefilled=prefilled)
