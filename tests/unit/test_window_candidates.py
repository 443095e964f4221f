"""A step's LM head over each request's whole candidate window (the engine's
`window_candidates`, CUDA's default): the same tokens as over the candidates alone,
with no sync before the LM head."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vllm_dllm.engine.op_count import OpCounter
from vllm_dllm.options import DreamOptions
from vllm_dllm.scheduler.track import RequestTrack
from tests.unit.test_multi_step_calls import CASES, drive
from tests.unit.test_step_engine import add_requests, llada, llada2, make_engine


def nonzeros(counter: OpCounter) -> int:
    """The candidate lists a counted stretch built (`nonzero(as_tuple=True)`)."""
    return counter.ops["nonzero"] + counter.ops["nonzero_numpy"]


def kind_of(options) -> str:
    if isinstance(options, DreamOptions):
        return "dream"
    return "llada2" if options.__class__.__name__.startswith("LLaDA2") else "llada"


@pytest.mark.parametrize("options,prompt_len", CASES + [
    pytest.param(dataclasses.replace(llada(cache="dual"), decoding="credit", credit_alpha=0.5), 12,
                 id="llada-credit"),  # credit updates per row: the candidates alone, as before
])
def test_window_rows_stream_the_tokens_of_candidate_rows(options, prompt_len):
    results = {}
    for window in (False, True):
        engine = make_engine(kind=kind_of(options), window_candidates=window)
        ids = add_requests(engine, 3, options, prompt_len=prompt_len)
        results[window] = drive(engine, ids, options, prompt_len, 8)
    assert results[True] == results[False]


def run_mixed(window: bool) -> dict[str, list[int]]:
    """Requests of block lengths 4, 8 and 16 in one batch, one step per call: the
    windows are 16 columns, and a 4- or 8-column block near the canvas's end passes
    it, so its window wraps to columns before the block."""
    engine = make_engine(window_candidates=window)
    options = {f"b{block}": llada(block=block, steps=32) for block in (4, 8, 16)}
    for i, (req, opts) in enumerate(options.items()):
        engine.add(req, [3 + (5 * i + j) % 50 for j in range(20)], opts, seed=i,
                   block_ids=list(range(1 + 10 * i, 11 + 10 * i)))
    streamed = {req: [] for req in options}
    live = list(options)
    while live:
        out = engine.step(live)
        for req, new, (block, _) in zip(list(live), out.new_tokens, out.progress):
            streamed[req] += new
            if block >= options[req].placed(20).num_blocks:
                live.remove(req)
    return streamed


def test_windows_of_mixed_block_lengths_wrap_before_the_block():
    plain, windowed = run_mixed(False), run_mixed(True)
    assert windowed == plain
    assert all(len(tokens) == 32 for tokens in plain.values())


@pytest.mark.parametrize("options,prompt_len", [
    pytest.param(llada(cache="dual"), 20, id="llada-dual"),
    pytest.param(llada2(), 16, id="llada2"),
])
def test_a_call_syncs_once_a_step_after_the_first(options, prompt_len):
    """Without the candidates' count, a call of k steps syncs only for the k - 1
    checks between its steps (the candidate rows' path syncs twice a step)."""
    syncs = {}
    for window in (False, True):
        engine = make_engine(kind=kind_of(options), window_candidates=window)
        ids = add_requests(engine, 2, options, prompt_len=prompt_len)
        engine.step(ids)  # the Refresh that fills the caches
        track = RequestTrack(options.placed(prompt_len), prompt_len, blocks=0, has_cache=True, block_step=1)
        steps = track.steps_in_call(8)
        planned = [track.call_tokens(steps)] * len(ids) if kind_of(options) == "llada" else None
        with OpCounter() as counter:
            ran = engine.step(ids, planned, steps=steps).steps
        assert ran == steps > 2
        syncs[window] = counter.syncs
    assert syncs[True] == ran - 1
    assert syncs[False] == 2 * ran - 1
    assert nonzeros(counter) == 0


def test_window_rows_cover_each_window_once():
    """window_rows: every request's window columns, no (row, column) pair twice,
    and a window passing the canvas's end takes columns before its start."""
    engine = make_engine(window_candidates=True)
    for i, block in enumerate((8, 16)):
        engine.add(f"b{block}", list(range(3, 23)), llada(block=block), seed=i,
                   block_ids=list(range(1 + 10 * i, 11 + 10 * i)))
    rule = engine.rule
    slots = torch.tensor([engine.slots["b8"], engine.slots["b16"]])
    engine.decode.block[slots] = torch.tensor([3, 1])  # columns 24.. (block 8), 16.. (block 16)
    rows, positions = rule.window_rows(slots.numpy(), slots, 32)
    pairs = list(zip(rows.tolist(), positions.tolist()))
    assert len(pairs) == len(set(pairs)) == 2 * 16
    assert sorted(p for r, p in pairs if r == 0) == list(range(16, 32))  # 24..31, then 15-j for j = 8..15
    assert sorted(p for r, p in pairs if r == 1) == list(range(16, 32))


def test_windows_above_the_row_bound_take_the_candidates():
    """Past WINDOW_ROWS rows of whole windows the LM head's extra rows would cost
    more than the sync: the step lists its candidates."""
    from vllm_dllm.engine.engine import WINDOW_ROWS

    options = llada(block=16)
    engine = make_engine(capacity=32, window_candidates=True)
    ids = add_requests(engine, WINDOW_ROWS // 16 + 1, options, prompt_len=4)
    with OpCounter() as counter:
        engine.step(ids)
    assert nonzeros(counter) == 1
    engine.remove(ids[-1])
    with OpCounter() as counter:
        engine.step(ids[:-1])
    assert nonzeros(counter) == 0


def test_a_sampled_step_lists_its_candidates_and_the_metric_counts_lm_head_rows():
    """A sampled row's reduce is work over the whole vocabulary: a step that samples
    lists its candidates.  A windowed step reports the window's rows as its LM-head
    rows (the logits_rows metric)."""
    sampled, greedy = make_engine(window_candidates=True), make_engine(window_candidates=True)
    ids = add_requests(sampled, 2, llada(T=0.7))
    with OpCounter() as counter:
        sampled.step(ids)
    assert nonzeros(counter) == 1
    ids = add_requests(greedy, 2, llada(block=8))
    with OpCounter() as counter:
        out = greedy.step(ids)
    assert nonzeros(counter) == 0
    assert out.logits_rows == 2 * 8
    plain = make_engine(window_candidates=False)
    ids = add_requests(plain, 2, llada(block=8))
    assert plain.step(ids).logits_rows == 2 * 8  # a block's first step: all 8 are candidates
    assert plain.step(ids).logits_rows == 2 * 7
