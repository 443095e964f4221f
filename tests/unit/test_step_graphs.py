"""Whole later steps of a call from one graph (engine/step_graphs.py), checked on the
CPU with the tape capture: the captured step is dropped, and a replay re-executes the
recorded ops on the tensors they read, failing where one of them was freed (what a
CUDA graph would read as reused memory)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vllm_dllm.engine.op_count import OpCounter
from vllm_dllm.engine.step_graphs import plain_facts
from vllm_dllm.options import DreamOptions
from tests.unit.test_multi_step_calls import dream, drive
from tests.unit.test_reuse_graphs import PagedReference, TapeCapture
from tests.unit.test_step_engine import add_requests, llada, llada2, make_engine


class CountedCapture(TapeCapture):
    """The tape capture, counting captures and replays and the host syncs a captured
    function dispatched (a CUDA graph can hold none)."""

    def __init__(self):
        self.captures = self.replays = self.syncs = 0

    def __call__(self, fn, pool):
        with OpCounter() as counter:
            replay, output = super().__call__(fn, pool)
        self.captures += 1
        self.syncs += counter.syncs

        def counted():
            self.replays += 1
            replay()

        return counted, output


def kind_of(options) -> str:
    if isinstance(options, DreamOptions):
        return "dream"
    return "llada2" if options.__class__.__name__.startswith("LLaDA2") else "llada"


def graphed_engine(kind="llada", capacity=16, **options):
    capture = CountedCapture()
    engine = make_engine(capacity=capacity, kind=kind, backend=PagedReference(), cuda_graphs=True,
                         graph_capture=capture, max_graph_seqs=8, window_candidates=True, **options)
    return engine, capture


def eager_engine(kind="llada", capacity=16):
    return make_engine(capacity=capacity, kind=kind, backend=PagedReference(), window_candidates=True)


GRAPHED = [
    pytest.param(llada(cache="dual"), 12, id="llada-dual"),
    pytest.param(llada(cache="dual", cfg=1.0), 12, id="llada-cfg"),
    pytest.param(dataclasses.replace(llada(cache="dual"), decoding="threshold", threshold=0.3), 12,
                 id="llada-threshold"),
    pytest.param(dataclasses.replace(llada(cache="dual"), remasking="random"), 12, id="llada-random-remasking"),
    pytest.param(dataclasses.replace(llada(cache="dual"), decoding="entropy_bound", gamma=0.5), 12,
                 id="llada-entropy-bound"),
    pytest.param(dataclasses.replace(llada(cache="dual"), decoding="hierarchy", threshold=0.5, low_threshold=0.1),
                 12, id="llada-hierarchy"),
    pytest.param(dataclasses.replace(llada(cache="sparse"), retention=0.3), 12, id="llada-sparse"),
    pytest.param(dream(), 12, id="dream-dual"),
    pytest.param(llada2(), 13, id="llada2"),
    pytest.param(llada2(editing=0.5), 13, id="llada2-editing"),
]


@pytest.mark.parametrize("options,prompt_len", GRAPHED)
def test_graphed_later_steps_stream_the_tokens_of_eager_steps(options, prompt_len):
    kind = kind_of(options)
    engine, capture = graphed_engine(kind)
    ids = add_requests(engine, 3, options, prompt_len=prompt_len)
    got = drive(engine, ids, options, prompt_len, 8)
    eager = eager_engine(kind)
    expected = drive(eager, add_requests(eager, 3, options, prompt_len=prompt_len), options, prompt_len, 8)
    assert got == expected
    # One whole-step graph, captured once (the rest are the forward's Reuse graphs),
    # and replayed by the later calls.
    assert len(engine.step_graphs.graphs) == 1
    assert capture.captures == 1 + len(engine.graphs.graphs) and capture.replays > capture.captures
    assert capture.syncs == 0


@pytest.mark.parametrize("options,prompt_len", [
    pytest.param(llada(cache="dual", T=0.7), 12, id="llada-sampled"),
    pytest.param(llada(cache="none"), 12, id="llada-no-cache"),  # every step a Refresh
    pytest.param(dataclasses.replace(llada(cache="dual"), decoding="credit", credit_alpha=0.5), 12,
                 id="llada-credit"),
])
def test_steps_a_graph_cannot_hold_run_step_by_step(options, prompt_len):
    """A sampled step, per-row credit: the rule lists its candidates (a sync sizes
    the LM head); without a cache every step is a Refresh: no step is captured, and
    the tokens are the eager engine's."""
    engine, _ = graphed_engine(kind_of(options))
    ids = add_requests(engine, 3, options, prompt_len=prompt_len)
    got = drive(engine, ids, options, prompt_len, 8)
    eager = eager_engine(kind_of(options))
    assert got == drive(eager, add_requests(eager, 3, options, prompt_len=prompt_len), options, prompt_len, 8)
    assert not engine.step_graphs.graphs


def test_batches_that_change_and_grow_replay_their_own_graphs():
    """Requests arrive and finish at different times, so calls carry 1, 2 or 3
    requests at different block steps; the batch outgrows its slots midway (its
    per-slot state is allocated anew, and graphs of the old slots are dropped)."""
    options = llada(cache="dual")
    runs = {}
    for graphed in (True, False):
        engine, capture = graphed_engine(capacity=2) if graphed else (eager_engine(capacity=2), None)
        streamed, live, arrivals = {}, [], {0: "a", 1: "b", 3: "c", 5: "d", 6: "e"}
        for call in range(40):
            if call in arrivals:
                req = arrivals[call]
                index = "abcde".index(req)
                engine.add(req, [3 + (5 * index + j) % 50 for j in range(12)], options, seed=index,
                           block_ids=list(range(1 + 8 * index, 9 + 8 * index)))
                streamed[req] = []
                live.append(req)
            if not live:
                continue
            out = engine.step(live, steps=3 if call % 2 else 8)
            for req, new, (block, _) in zip(list(live), out.new_tokens, out.progress):
                streamed[req] += new
                if block >= options.placed(12).num_blocks:
                    live.remove(req)
                    engine.remove(req)
        runs[graphed] = streamed
        if graphed:
            assert engine.capacity > 2
            assert {key[0] for key in engine.step_graphs.graphs} == {engine.capacity}
            assert capture.replays > capture.captures
    assert runs[True] == runs[False]
    assert all(len(tokens) == 32 for tokens in runs[True].values())


def test_a_graphed_call_syncs_once_a_step_after_the_first():
    options = llada(cache="dual")
    engine, _ = graphed_engine()
    ids = add_requests(engine, 2, options)
    engine.step(ids)  # Refresh
    engine.step(ids, steps=7)  # captures the later steps' graph
    engine.step(ids)  # the next block's Refresh
    with OpCounter() as counter:
        out = engine.step(ids, steps=7)
    assert out.steps == 7
    assert counter.syncs == out.steps - 1


def test_a_table_widened_at_admission_drops_the_graphs_that_read_it():
    """Dream widens its per-slot table of unmasking fractions when a request with
    more steps per block arrives: graphs captured before read the old table (freed,
    and narrower), so they are dropped and captured again."""
    def run(engine):
        out = []
        engine.add("a", [3 + j for j in range(12)], dataclasses.replace(dream(), steps=16), seed=0,
                   block_ids=list(range(1, 9)))  # 4 steps per block
        engine.step(["a"])
        out.append(engine.step(["a"], steps=3).new_tokens)  # captures
        engine.add("b", [5 + j for j in range(12)], dream(), seed=1, block_ids=list(range(9, 17)))  # 8 a block
        for _ in range(2):
            engine.step(["a"])
            out.append(engine.step(["a"], steps=3).new_tokens)
        return out

    engine, capture = graphed_engine("dream")
    assert run(engine) == run(eager_engine("dream"))
    assert capture.captures - len(engine.graphs.graphs) == 2  # whole-step graphs: before and after
    assert len(engine.step_graphs.graphs) == 1


class WarmedCapture(CountedCapture):
    """As torch's capture does, runs the function twice before capturing it."""

    def __call__(self, fn, pool):
        fn()
        fn()
        return super().__call__(fn, pool)


@pytest.mark.parametrize("options,prompt_len", [
    pytest.param(llada(cache="dual"), 12, id="llada-dual"),
    pytest.param(llada2(editing=0.5), 13, id="llada2-editing"),
])
def test_a_capture_that_runs_the_step_leaves_the_slots_as_it_found_them(options, prompt_len):
    """Warm-up runs commit tokens and advance steps; the capture puts the slots'
    state back, so the replay after it is the call's step."""
    kind = kind_of(options)
    capture = WarmedCapture()
    engine = make_engine(kind=kind, backend=PagedReference(), cuda_graphs=True, graph_capture=capture,
                         max_graph_seqs=8, window_candidates=True)
    got = drive(engine, add_requests(engine, 2, options, prompt_len=prompt_len), options, prompt_len, 8)
    eager = eager_engine(kind)
    assert got == drive(eager, add_requests(eager, 2, options, prompt_len=prompt_len), options, prompt_len, 8)
    assert capture.captures >= 1


def test_plain_facts_are_what_chooses_a_steps_ops():
    engine, _ = graphed_engine()
    ids = add_requests(engine, 2, llada(cache="dual"))
    engine.rule.prepare([engine.slots[r] for r in ids])
    facts = dict(((name, value) for _, name, value in plain_facts(engine.rule.slot_holders())))
    assert facts["sampled"] is False and facts["remasks_randomly"] is False
    assert "present" in facts and isinstance(facts["present"], tuple)
    assert not any(isinstance(value, torch.Tensor) for value in facts.values())


def test_whole_step_graphs_need_reuse_graphs_windows_and_the_whole_vocabulary():
    assert graphed_engine()[0].step_graphs is not None
    assert graphed_engine(step_graphs=False)[0].step_graphs is None
    assert make_engine(backend=PagedReference(), cuda_graphs=True, graph_capture=CountedCapture(),
                       window_candidates=False).step_graphs is None
    assert eager_engine().step_graphs is None


class FailingCapture(CountedCapture):
    """Runs the function (a warm-up) and then fails with `error`, except for the
    forward's own Reuse graphs."""

    def __init__(self, error: Exception):
        super().__init__()
        self.error = error

    def __call__(self, fn, pool):
        output = fn()
        if output.dtype == torch.long:  # a whole step's [tally, goes on]
            raise self.error
        return super().__call__(fn, pool)


@pytest.mark.parametrize("error", [
    torch.cuda.OutOfMemoryError("CUDA out of memory (stand-in)"),
    RuntimeError("operation not permitted when stream is capturing (stand-in)"),
], ids=["out-of-memory", "not-capturable"])
def test_a_failed_capture_leaves_later_steps_step_by_step(error):
    options = llada(cache="dual")
    capture = FailingCapture(error)
    engine = make_engine(backend=PagedReference(), cuda_graphs=True, graph_capture=capture, max_graph_seqs=8,
                         window_candidates=True)
    got = drive(engine, add_requests(engine, 2, options, prompt_len=12), options, 12, 8)
    eager = eager_engine()
    assert got == drive(eager, add_requests(eager, 2, options, prompt_len=12), options, 12, 8)
    assert not engine.step_graphs.graphs and engine.graphs.graphs  # the forward graphs stay


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="a real CUDA graph needs a CUDA device; the same cases ran above with the tape capture")
def test_real_cuda_graphs_stream_the_tokens_of_reuse_graphs_alone():
    """On a GPU (benchmarks/gpu_session.sh check): torch.cuda.graph captures, the
    device's attention backend, every graphed case against the same engine with
    Reuse graphs alone (the same forward kernels, the rule eager)."""
    from vllm_dllm.attention.backends import select_backend
    from vllm_dllm.engine.engine import StepEngine
    from vllm_dllm.engine.torch_model import build_model
    from tests.unit.test_step_engine import BLOCK_SIZE, IDS, SHAPE

    device = torch.device("cuda")

    def cuda_engine(kind, step_graphs):
        model = build_model(SHAPE, torch.float32, device, seed=0)
        model.allocate_kv_pool(num_blocks=512, block_size=BLOCK_SIZE, dtype=torch.float32, device=device)
        return StepEngine(model, kind=kind, ids=IDS, capacity=16, max_model_len=128, block_size=BLOCK_SIZE,
                          max_num_logits=1024, backend=select_backend(device), device=device, cuda_graphs=True,
                          max_graph_seqs=8, step_graphs=step_graphs)

    failures = []
    for case in GRAPHED:
        options, prompt_len = case.values
        runs = {}
        for step_graphs in (True, False):
            engine = cuda_engine(kind_of(options), step_graphs)
            runs[step_graphs] = drive(engine, add_requests(engine, 3, options, prompt_len=prompt_len), options,
                                      prompt_len, 8)
            if step_graphs and (engine.step_graphs is None or not engine.step_graphs.graphs):
                failures.append(f"{case.id}: no whole step captured")
        if runs[True] != runs[False]:
            failures.append(f"{case.id}: tokens differ")
    assert not failures, failures
