"""Several denoising steps per engine call: the same tokens as one step per call, the
scheduler's pricing equal to what the engine runs, and a call's cost flat in the
number of requests (counted torch ops per call)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from vllm_dllm.engine.op_count import OpCounter
from vllm_dllm.options import DreamOptions
from vllm_dllm.scheduler.track import RequestTrack
from tests.unit.test_step_engine import add_requests, llada, llada2, make_engine


def dream(cache="dual") -> DreamOptions:
    return DreamOptions(gen_length=32, steps=32, block_length=8, alg="entropy", alg_temp=None, eps=1e-3,
                        temperature=0.0, top_p=None, top_k=None, cache=cache)


def drive(engine, ids, options, prompt_len, limit, preempt_after=()):
    """Run every request to the end as the scheduler would: each call's steps and
    priced tokens from a RequestTrack per request; after the calls numbered in
    `preempt_after`, every request loses its cache (preemption).  Returns the tokens
    streamed per request and the steps of each call."""
    tracks = {r: RequestTrack(options.placed(prompt_len), prompt_len, blocks=0) for r in ids}
    streamed = {r: [] for r in ids}
    calls = []
    while True:
        if len(calls) in preempt_after:
            for r in ids:
                engine.drop_cache(r)
                tracks[r].evicted, tracks[r].has_cache = tracks[r].has_cache, False
        live = [r for r in ids if tracks[r].block < tracks[r].num_blocks]
        if not live:
            return streamed, calls
        steps = min(tracks[r].steps_in_call(limit) for r in live)
        planned = [tracks[r].call_tokens(steps) for r in live]
        phases = [tracks[r].phase() for r in live]
        out = engine.step(live, planned, steps=steps)
        assert 1 <= out.steps <= steps
        calls.append(out.steps)
        for r, new, phase, progress in zip(live, out.new_tokens, phases, out.progress):
            streamed[r] += new
            tracks[r].advance(phase, progress)


CASES = [
    pytest.param(llada(cache="dual"), 12, id="llada-dual"),
    pytest.param(llada(cache="none"), 12, id="llada-none"),
    pytest.param(llada(cache="prefix"), 12, id="llada-prefix"),
    pytest.param(llada(cache="dual", delay=1), 12, id="llada-delayed-refresh"),
    pytest.param(dataclasses.replace(llada(cache="dual"), refresh_interval=3), 12, id="llada-periodic-refresh"),
    pytest.param(llada(cache="dual", cfg=1.0, T=0.7), 12, id="llada-cfg-sampled"),
    pytest.param(dataclasses.replace(llada(cache="dual"), decoding="threshold", threshold=0.3), 12,
                 id="llada-threshold"),
    pytest.param(dataclasses.replace(llada(cache="sparse"), retention=0.3), 12, id="llada-sparse"),
    pytest.param(dream(), 12, id="dream-dual"),
    pytest.param(llada2(), 13, id="llada2"),
    pytest.param(llada2(editing=0.5, T=0.8), 13, id="llada2-editing"),
]


@pytest.mark.parametrize("options,prompt_len", CASES)
def test_calls_of_several_steps_stream_the_tokens_of_single_steps(options, prompt_len):
    kind = "dream" if isinstance(options, DreamOptions) else "llada2" if options.__class__.__name__.startswith(
        "LLaDA2") else "llada"
    results = {}
    for limit in (1, 3, 8):  # calls of 3 start inside blocks: a Reuse first, laid out as the later ones
        engine = make_engine(kind=kind)
        ids = add_requests(engine, 3, options, prompt_len=prompt_len)
        results[limit] = drive(engine, ids, options, prompt_len, limit)
    single, single_calls = results[1]
    assert set(single_calls) == {1}
    for limit in (3, 8):
        several, several_calls = results[limit]
        assert several == single, limit
        assert len(several_calls) < len(single_calls)  # the calls did run several steps
        assert sum(several_calls) == len(single_calls)  # and the same steps in all


@pytest.mark.parametrize("options", [
    pytest.param(llada(cache="dual"), id="dual"),
    pytest.param(dataclasses.replace(llada(cache="sparse", delay=1), retention=0.3), id="sparse-delayed"),
])
def test_calls_after_preemption_stream_the_tokens_of_single_steps(options):
    """A preempted request's next call rebuilds its cache (a Reuse: that step runs
    alone) or refreshes it (a Refresh, after which the call goes on over the
    refreshed cache)."""
    results = {}
    for limit, preempt_after in ((1, ()), (8, (1, 3, 4))):
        engine = make_engine()
        ids = add_requests(engine, 2, options)
        results[limit] = drive(engine, ids, options, 20, limit, preempt_after)
    assert results[8][0] == results[1][0]
    assert max(results[8][1]) > 1


def test_a_block_ended_early_ends_the_call():
    """Under a threshold rule a block may end before the fixed schedule's steps: the
    call stops there and reports the next block, whose first step is a Refresh."""
    options = dataclasses.replace(llada(cache="dual"), decoding="threshold", threshold=0.0)  # a block a step
    engine = make_engine()
    ids = add_requests(engine, 1, options)
    track = RequestTrack(options, 20, blocks=0)
    track.advance(track.phase(), engine.step(ids).progress[0])  # the first block, in one step
    assert (track.block, track.block_step) == (1, 0)
    steps = track.steps_in_call(8)
    assert steps == 8  # the fixed schedule's bound: 8 steps a block
    out = engine.step(ids, [track.call_tokens(steps)], steps=steps)
    assert out.steps == 1 and out.progress[0] == (2, 0)


def test_steps_in_call_stop_where_the_phase_changes():
    track = RequestTrack(llada(cache="dual", delay=1), 20, blocks=0)
    assert track.steps_in_call(8) == 1  # no cache yet: a Refresh that fills it, then a delayed Refresh
    track.has_cache, track.block_step = True, 2
    assert track.steps_in_call(8) == 6  # Reuse steps to the end of the block
    assert track.steps_in_call(4) == 4
    assert track.call_tokens(4) == track.tokens * 4
    periodic = RequestTrack(dataclasses.replace(llada(cache="dual"), refresh_interval=3), 20, blocks=0,
                            has_cache=True, block_step=1)
    assert periodic.steps_in_call(8) == 2  # steps 1 and 2; step 3 refreshes
    exact = RequestTrack(llada(cache="none"), 20, blocks=0)
    assert exact.steps_in_call(8) == 8 and exact.call_tokens(8) == 8 * (20 + 32)
    scoring = RequestTrack(llada(cache="none"), 20, blocks=0, scoring=5)
    assert scoring.steps_in_call(8) == 1


@pytest.mark.parametrize("options,prompt_len", [
    pytest.param(llada(cache="dual"), 20, id="llada-dual"),
    pytest.param(dataclasses.replace(llada(cache="dual"), decoding="threshold", threshold=1.0), 20,
                 id="llada-threshold"),
    pytest.param(llada2(), 16, id="llada2"),  # a whole block of masks: one a step, 8 steps
])
def test_call_op_count_does_not_grow_with_requests(options, prompt_len):
    counts = {}
    kind = "llada2" if options.__class__.__name__.startswith("LLaDA2") else "llada"
    for requests in (1, 4, 16):
        engine = make_engine(kind=kind)
        ids = add_requests(engine, requests, options, prompt_len=prompt_len)
        engine.step(ids)  # the Refresh (LLaDA2: the prompt's blocks); the next steps are alike
        track = RequestTrack(options.placed(prompt_len), prompt_len, blocks=0, has_cache=True, block_step=1)
        steps = track.steps_in_call(4)
        assert steps == 4
        with OpCounter() as counter:
            out = engine.step(ids, [track.call_tokens(steps)] * requests, steps=steps)
        assert out.steps == steps
        counts[requests] = (counter.total, counter.syncs)
    assert counts[1] == counts[4] == counts[16], counts
    # A sync per step for its candidates' count, and one per later step for the
    # block check.
    assert counts[1][1] == 4 + 3, counts


def test_a_call_that_must_run_alone_is_refused():
    engine = make_engine()
    ids = add_requests(engine, 1, llada(cache="dual"))
    with pytest.raises(RuntimeError, match="prompt scoring"):
        engine.prompt_scorer.admit(engine.slots[ids[0]], 2, 0)
        engine.step(ids, steps=2)
    assert np.all(engine.host.block_step[[engine.slots[ids[0]]]] == 0)


def test_a_call_ends_once_every_request_streamed_a_stop_token():
    """The call stops after the step that makes a stop token final (vLLM finishes the
    request there); without stop tokens it runs the block's steps."""
    options = llada(cache="none")  # blocks of 8 steps, every step a Refresh
    for variant in range(20):
        prompt = [3 + (5 * variant + 7 * j) % 50 for j in range(20)]
        probe = make_engine()
        probe.add("r", prompt, options, seed=variant, block_ids=list(range(1, 9)))
        first_final = next((step, out.new_tokens[0][0]) for step in range(8)
                           if (out := probe.step(["r"])).new_tokens[0])
        if first_final[0] < 7:  # final before the block's last step: an early end to see
            break
    else:
        pytest.fail("no draw made a token final before the block's last step")
    step, token = first_final
    for stop_ids, ran in (((token,), step + 1), ((), 8)):
        engine = make_engine()
        engine.add("r", prompt, options, seed=variant, block_ids=list(range(1, 9)), stop_ids=stop_ids)
        track = RequestTrack(options, 20, blocks=0)
        out = engine.step(["r"], [track.call_tokens(8)], steps=track.steps_in_call(8))
        assert out.steps == ran and out.new_tokens[0][0] == token
