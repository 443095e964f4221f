"""CUDA graphs for Reuse steps (engine/graphs.py): which steps replay a graph, and the
padding and static-buffer plumbing, checked on the CPU by a capture that re-runs the
captured function on the graph's own buffers (what a replay does on a GPU)."""

from __future__ import annotations

import contextlib
import gc
import weakref
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from vllm_dllm.attention.backends import TorchAttention, write_kv
from vllm_dllm.engine.engine import StepEngine
from vllm_dllm.engine import graphs as graphs_module
from vllm_dllm.engine.graphs import ReuseGraphs, capture_cuda_graph, seq_bucket
from vllm_dllm.engine.torch_model import build_model
from tests.unit.test_step_engine import BLOCK_SIZE, IDS, SHAPE, add_requests, llada


class PagedReference:
    """Attention that reads only the metadata's tensors (like the Triton kernel), so
    it is graph-safe: every shape is fixed by (sequences, queries, block-table width)."""

    name = "paged-reference"
    graph_safe = True

    def attend(self, q, k, v, cache, meta, scale):
        if cache is None:  # in flight (a sparse Refresh): eager only, the reference's own path
            return TorchAttention().attend(q, k, v, cache, meta, scale)
        write_kv(cache, k, v, meta.query_slots)
        bs = cache.shape[1]
        columns = torch.arange(meta.block_table.shape[1] * bs)
        valid = columns < meta.seq_lens[:, None]
        logical = torch.where(valid, meta.kv_start[:, None].long() + columns, 0)
        slots = meta.block_table.long().gather(1, logical // bs) * bs + logical % bs
        kv = cache[slots // bs, slots % bs].to(q.dtype)  # [S, W, 2, Hk, D]
        row_seq = torch.searchsorted(meta.query_start_loc[1:].long(), torch.arange(len(q)), right=True)
        group = q.shape[1] // kv.shape[3]
        keys = kv[row_seq, :, 0].repeat_interleave(group, dim=2)  # [T, W, H, D]
        values = kv[row_seq, :, 1].repeat_interleave(group, dim=2)
        scores = torch.einsum("thd,twhd->thw", q, keys) * scale
        scores = scores.masked_fill(~valid[row_seq][:, None, :], float("-inf"))
        return torch.einsum("thw,twhd->thd", scores.softmax(-1), values)


class RerunCapture:
    """The CPU stand-in for torch.cuda.graph: replay re-runs the captured function,
    which reads only the graph's static buffers and the metadata frozen at capture."""

    def __init__(self):
        self.captures = 0
        self.replays = 0

    def __call__(self, fn, pool):
        self.captures += 1
        output = fn()

        def replay():
            self.replays += 1
            output.copy_(fn())

        return replay, output


class _Tape(TorchDispatchMode):
    """Records every op a function dispatches, with the tensors it reads and makes."""

    def __init__(self):
        super().__init__()
        self.ops = []
        self.made: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        self.made.update(id(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        return out


class TapeCapture:
    """A closer CPU stand-in for torch.cuda.graph: the captured function is run once
    and dropped; replay re-executes the recorded ops on the recorded tensors.  Like a
    CUDA graph, the tape owns what the capture allocated (its private pool) but only
    points at the tensors it read from outside: a replay after one of those was freed
    fails, where on a GPU it would read reused memory."""

    class FreedInput(RuntimeError):
        pass

    def __call__(self, fn, pool):
        with _Tape() as tape:
            output = fn()
        del fn

        def hold(value):
            if not isinstance(value, torch.Tensor) or id(value) in tape.made:
                return value
            return weakref.ref(value)  # made outside the capture: pointed at, not owned

        ops = [(func, tree_map(hold, args), tree_map(hold, kwargs), out) for func, args, kwargs, out in tape.ops]

        def resolve(value):
            if isinstance(value, weakref.ref):
                value = value()
                if value is None:
                    raise TapeCapture.FreedInput("the captured forward reads a tensor freed after capture")
            return value

        replays = []

        def replay():
            # A tensor in a reference cycle is freed only when the collector runs:
            # collect before the first replay (the capture's temporaries) and every
            # 8th after it (what later calls drop), not before each (a tenth of a
            # second apiece).
            if len(replays) % 8 == 0:
                gc.collect()
            replays.append(None)
            for func, args, kwargs, out in ops:
                args, kwargs = tree_map(resolve, args), tree_map(resolve, kwargs)
                result = func(*args, **kwargs)
                writes = any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)
                if writes:
                    continue  # in-place ops wrote their arguments
                bases = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                         if isinstance(t, torch.Tensor)} if func.is_view else set()
                for recorded, fresh in zip(tree_flatten(out)[0], tree_flatten(result)[0]):
                    # A view aliases its base, except where an op that may alias copied
                    # instead (`to` a new dtype): its recorded output is a buffer of its own.
                    if isinstance(recorded, torch.Tensor) and recorded.untyped_storage().data_ptr() not in bases:
                        recorded.copy_(fresh)

        return replay, output


def engine_with(backend, capture=None, capacity=8):
    model = build_model(SHAPE, torch.float32, "cpu", seed=0)
    model.allocate_kv_pool(num_blocks=512, block_size=BLOCK_SIZE, dtype=torch.float32, device="cpu")
    return StepEngine(
        model, kind="llada", ids=IDS, capacity=capacity, max_model_len=128, block_size=BLOCK_SIZE,
        max_num_logits=1024, backend=backend, device=torch.device("cpu"),
        cuda_graphs=capture is not None, max_graph_seqs=8, graph_capture=capture,
    )


def test_sequence_buckets():
    assert [seq_bucket(n, 64) for n in (1, 2, 3, 4, 5, 33, 64)] == [1, 2, 4, 4, 8, 64, 64]
    assert seq_bucket(65, 64) is None


def test_only_uniform_reuse_steps_replay_a_graph():
    model = build_model(SHAPE, torch.float32, "cpu", seed=0)
    graphs = ReuseGraphs(model, PagedReference(), device=torch.device("cpu"), block_size=BLOCK_SIZE,
                         max_blocks=16, max_seqs=8, capture=RerunCapture())
    reuse = np.zeros(3, dtype=bool)
    assert graphs.key(np.array([8, 8, 8]), reuse, False) == (4, 8, False)
    assert graphs.key(np.array([8, 8, 8]), reuse, True) == (4, 8, True)
    assert graphs.key(np.array([8, 8, 8]), np.array([False, True, False]), False) is None  # a Refresh
    assert graphs.key(np.array([8, 16, 8]), reuse, False) is None  # mixed block lengths
    assert graphs.key(np.full(9, 8), np.zeros(9, dtype=bool), False) is None  # above the largest bucket


def test_graphs_need_a_graph_safe_backend_and_a_cuda_device():
    model = build_model(SHAPE, torch.float32, "cpu", seed=0)
    with pytest.raises(ValueError, match="'torch' cannot be captured"):
        ReuseGraphs(model, TorchAttention(), device=torch.device("cpu"), block_size=BLOCK_SIZE, max_blocks=4,
                    max_seqs=8, capture=RerunCapture())
    with pytest.raises(ValueError, match="need a CUDA device, not cpu"):
        ReuseGraphs(model, PagedReference(), device=torch.device("cpu"), block_size=BLOCK_SIZE, max_blocks=4,
                    max_seqs=8)
    # The engine leaves graphs off where they cannot run, rather than failing to start.
    assert engine_with(TorchAttention(), RerunCapture()).graphs is None
    assert engine_with(PagedReference()).graphs is None  # cuda_graphs off


@pytest.mark.parametrize("cfg", [0.0, 1.0])
def test_graphed_reuse_steps_equal_eager_steps(cfg):
    """Batches that shrink and grow across buckets replay padded graphs; tokens equal
    the eager engine's, and the pool differs only in the scratch block."""
    capture = RerunCapture()
    graphed, eager = engine_with(PagedReference(), capture), engine_with(PagedReference())
    options = llada(gen=32, steps=32, block=32, cache="dual", cfg=cfg)  # one block: one Refresh
    schedule = [5, 5, 5, 3, 3, 2, 5, 1, 5, 5]  # requests scheduled per step (r0..r{n-1})
    got, expected = [], []
    for engine, out in ((graphed, got), (eager, expected)):
        ids = add_requests(engine, 5, options)
        for count in schedule:
            out.append(engine.step(ids[:count]).new_tokens)
    assert got == expected
    # Step 0 of every request is its Refresh (eager); the Reuse steps replayed graphs
    # keyed by bucket: 8 (5 requests; 10 sequences with CFG twins is above the
    # largest bucket, so eager), 4 (3), 2 (2), 1 (1).
    sequences = [n * (2 if cfg else 1) for n in schedule[1:]]
    buckets = {seq_bucket(n, 8) for n in sequences} - {None}
    assert {key[0] for key in graphed.graphs.graphs} == buckets
    assert capture.captures == len(buckets)
    assert capture.replays == sum(seq_bucket(n, 8) is not None for n in sequences)
    for a, b in zip(graphed.model.attention_layers(), eager.model.attention_layers()):
        torch.testing.assert_close(a.kv_cache[1:], b.kv_cache[1:], rtol=1e-5, atol=1e-5)
        assert not torch.equal(a.kv_cache[0], b.kv_cache[0])  # padding wrote the scratch block only


def test_a_replay_reads_only_tensors_the_graphs_own():
    """The captured forward is dropped after capture, as torch.cuda.graph leaves it:
    every tensor a replay reads (static buffers, the frozen metadata) must still be
    alive, and the replays still give the eager engine's tokens."""
    options = llada(gen=32, steps=32, block=32, cache="dual")
    schedule = [3, 3, 3, 2, 3, 3]
    got, expected = [], []
    for engine, out in ((engine_with(PagedReference(), TapeCapture()), got), (engine_with(PagedReference()), expected)):
        ids = add_requests(engine, 3, options)
        for count in schedule:
            out.append(engine.step(ids[:count]).new_tokens)
    assert got == expected


def test_padding_never_writes_blocks_a_finished_request_handed_on():
    """A smaller batch in the same bucket must not replay the departed request's rows:
    its KV blocks now belong to another request."""
    options = llada(gen=32, steps=32, block=32, cache="dual")
    pools = []
    for engine in (engine_with(PagedReference(), RerunCapture()), engine_with(PagedReference())):
        ids = add_requests(engine, 4, options)
        engine.step(ids)  # Refresh
        engine.step(ids)  # Reuse of 4: bucket 4
        engine.remove("r3")
        engine.add("late", [9] * 20, options, seed=7, block_ids=list(range(1 + 3 * 7, 1 + 4 * 7)))  # r3's blocks
        engine.step(["late"])  # its Refresh fills those blocks
        engine.step(ids[:3])  # Reuse of 3: bucket 4 again
        pools.append([layer.kv_cache[1:].clone() for layer in engine.model.attention_layers()])
    for graphed, eager in zip(*pools):
        torch.testing.assert_close(graphed, eager, rtol=1e-5, atol=1e-5)


def test_a_capture_context_surrounds_the_capture_but_not_the_warm_up(monkeypatch):
    """Under tensor parallelism the capture runs inside vLLM's graph_capture (its custom
    all-reduce registers the captured buffers on exit); the warm-up runs outside it,
    where an all-reduce still computes.  Checked against a recording stand-in for
    torch.cuda's stream and graph calls."""
    events = []

    @contextlib.contextmanager
    def span(name):
        events.append(f"enter {name}")
        yield
        events.append(f"exit {name}")

    class Stream:
        def wait_stream(self, other):
            pass

    class Graph:
        def replay(self):
            events.append("replay")

    fake_cuda = SimpleNamespace(
        Stream=Stream, current_stream=Stream, stream=lambda s: span("side stream"), CUDAGraph=Graph,
        graph=lambda graph, pool: span("graph"),
    )
    monkeypatch.setattr(graphs_module, "torch", SimpleNamespace(cuda=fake_cuda))  # this module's view only

    def forward():
        events.append("forward")
        return torch.zeros(1)

    replay, _ = capture_cuda_graph(forward, pool=None, capture_context=lambda: span("tp capture"))
    replay()
    assert events == [
        "enter side stream", "forward", "forward", "exit side stream",
        "enter tp capture", "enter graph", "forward", "exit graph", "exit tp capture",
        "replay",
    ]


@pytest.mark.usefixtures("plugin_logs")
def test_a_full_set_of_graphs_takes_no_new_shape_and_says_so_once(caplog):
    owner = SimpleNamespace(graphs={key: None for key in range(graphs_module.MAX_GRAPHS)}, _warned_full=False)
    assert graphs_module.has_room(owner, 3, "graphs captured")  # a shape it holds replays
    with caplog.at_level("WARNING"):
        assert not graphs_module.has_room(owner, "new", "graphs captured; further shapes run eagerly")
        assert not graphs_module.has_room(owner, "newer", "graphs captured; further shapes run eagerly")
    assert [r.getMessage() for r in caplog.records] == [
        f"{graphs_module.MAX_GRAPHS} graphs captured; further shapes run eagerly"]
    assert graphs_module.has_room(SimpleNamespace(graphs={}, _warned_full=False), "new", "")
