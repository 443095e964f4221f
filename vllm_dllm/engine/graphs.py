"""CUDA graphs for Reuse steps.  Imports no vLLM.

A Reuse step is the common step of a cached request (every step of a block but the
Refresh at its start) and on a GPU its eager launch overhead is a large share of its
cost: a 1-request Reuse of an 8B model is ~20 ms eager against a ~5 ms weights-read
floor.  Reuse steps whose sequences all have the same query count q (the block
length) have shapes that depend only on (number of sequences, q), so the forward is
captured once per (sequence bucket, q, CFG twins present) and replayed:

  * sequences are padded up to a power-of-two bucket; a padding sequence has q query
    rows that read and write only the scratch block (vLLM's never-allocated null
    block 0), attend over one position, and are never read back;
  * the per-step inputs (token ids, positions, pool slots, sequence lengths, KV
    offsets, block tables) are copied into the graph's static buffers, a constant
    number of copies whatever the batch; `query_start_loc` is `q * arange` for every
    step of a key and never changes;
  * the attention backend must read only those tensors and the fixed q
    (`graph_safe`): the Triton and flash-attention backends do, the torch backend
    (host-built padded groups) does not.

Refresh steps, mixed query counts and batches above the largest bucket run eagerly,
as does everything when graphs are off (vLLM's `enforce_eager`).  The capture
function is injected: `capture_cuda_graph` on CUDA; tests on a CPU pass one that
re-runs the captured function on the static buffers, which checks the padding and
buffer plumbing without a GPU.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np
import torch

from vllm_dllm.attention.metadata import AttentionMetadata, attention_metadata
from vllm_dllm.log import get_logger

logger = get_logger(__name__)

# A graph per (bucket, q) holds its own activations in the shared pool; a server
# sees a handful of block lengths, so this only bounds a pathological mix.
MAX_GRAPHS = 32

# capture(fn, pool) -> (replay, output): `replay()` re-runs what `fn()` did on the
# buffers `fn` reads and leaves the result in `output`.
Capture = Callable[[Callable[[], torch.Tensor], object], tuple[Callable[[], None], torch.Tensor]]


def capture_cuda_graph(
    fn: Callable[[], torch.Tensor], pool, capture_context: Callable[[], contextlib.AbstractContextManager] | None = None
) -> tuple[Callable[[], None], torch.Tensor]:
    """`capture_context`, when given, surrounds the capture itself (not the warm-up):
    under tensor parallelism, vLLM's `graph_capture`, whose custom all-reduce records
    the buffers a captured all-reduce uses and registers them when it exits; inside
    it an all-reduce outside a capture returns garbage."""
    # Warm-up on a side stream (Triton compiles, cuBLAS picks its kernels and
    # allocates its workspace), as torch's graph capture requires.
    current = torch.cuda.current_stream()
    stream = torch.cuda.Stream()
    stream.wait_stream(current)
    try:
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
    finally:  # what the warm-up queued comes before anything after it, failed or not
        current.wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with capture_context() if capture_context is not None else contextlib.nullcontext():
            with torch.cuda.graph(graph, pool=pool):
                output = fn()
    except BaseException:
        # A capture that failed may leave its own stream current: eager work after
        # it must run where it did before.
        torch.cuda.set_stream(current)
        raise
    return graph.replay, output


def has_room(owner, key, full: str) -> bool:
    """Whether `owner.graphs` holds `key` or has room for it (MAX_GRAPHS); the first
    time it has none, logs that it is `full`."""
    if key in owner.graphs or len(owner.graphs) < MAX_GRAPHS:
        return True
    if not owner._warned_full:
        logger.warning("%d %s", MAX_GRAPHS, full)
        owner._warned_full = True
    return False


def seq_bucket(num_seqs: int, max_seqs: int) -> int | None:
    """The smallest power of two >= num_seqs, or None above max_seqs."""
    bucket = 1 << max(0, (num_seqs - 1).bit_length())
    return bucket if bucket <= max_seqs else None


@dataclass
class ForwardGraph:
    replay: Callable[[], None]
    output: torch.Tensor
    input_ids: torch.Tensor
    positions: torch.Tensor
    query_slots: torch.Tensor
    seq_lens: torch.Tensor
    kv_start: torch.Tensor
    block_table: torch.Tensor
    padding: dict[str, torch.Tensor]  # the padded tail of each buffer, restored every step
    # The metadata the captured forward reads.  A CUDA graph keeps raw device
    # pointers, not references: every tensor it reads must be owned here.
    meta: AttentionMetadata | None = None

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """The step's inputs into the buffers, their tails back to padding: a
        constant number of copies whatever the batch."""
        tokens, seqs = len(input_ids), meta.num_seqs
        for name, value, count in (
            ("input_ids", input_ids, tokens),
            ("positions", positions, tokens),
            ("query_slots", meta.query_slots, tokens),
            ("seq_lens", meta.seq_lens, seqs),
            ("kv_start", meta.kv_start, seqs),
            ("block_table", meta.block_table, seqs),
        ):
            buffer = getattr(self, name)
            buffer[:count].copy_(value)
            buffer[count:].copy_(self.padding[name][count:])


class ReuseGraphs:
    """Captured forwards of uniform Reuse steps, keyed by (sequence bucket, q, whether
    any sequence reads its K/V at an offset: a CFG twin, which some backends route
    differently)."""

    def __init__(
        self,
        model,
        backend,
        *,
        device: torch.device,
        block_size: int,
        max_blocks: int,
        max_seqs: int,
        scratch_block: int = 0,
        capture: Capture | None = None,
        model_context=None,
    ):
        if capture is None and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device.type}")
        if not getattr(backend, "graph_safe", False):
            raise ValueError(f"attention backend {backend.name!r} cannot be captured in a graph")
        self.model = model
        self.model_context = model_context or (lambda num_tokens: contextlib.nullcontext())
        self.backend = backend
        self.device = device
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.max_seqs = max_seqs
        self.scratch_block = scratch_block
        self.capture = capture or capture_cuda_graph
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.graphs: dict[tuple[int, int, bool], ForwardGraph] = {}
        self._warned_full = False

    def key(self, num_queries: np.ndarray, refresh: np.ndarray, has_kv_offset: bool) -> tuple[int, int, bool] | None:
        """(bucket, q, has_kv_offset) when the step can replay a graph, else None (eager)."""
        if refresh.any() or len(num_queries) == 0:
            return None
        q = int(num_queries[0])
        if q <= 0 or not (num_queries == q).all():
            return None
        bucket = seq_bucket(len(num_queries), self.max_seqs)
        if bucket is None:
            return None
        key = (bucket, q, bool(has_kv_offset))
        return key if has_room(self, key, "Reuse graphs captured; further shapes run eagerly") else None

    @torch.inference_mode()
    def forward(self, key: tuple[int, int, bool], input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states of the step's query rows (a view of the graph's output,
        valid until the next replay of the same graph)."""
        graph = self.graphs.get(key)
        fresh = graph is None
        if fresh:
            graph = self.buffers(*key[:2])
        graph.load(input_ids, positions, meta)
        if fresh:
            graph.replay, graph.output = self.capture(self.static_forward(graph, key, meta), self.pool)
            self.graphs[key] = graph
            logger.info("Captured the Reuse forward for %d sequences x %d queries%s", key[0], key[1],
                        " (CFG)" if key[2] else "")
        graph.replay()
        return graph.output[:len(input_ids)]

    def buffers(self, bucket: int, q: int) -> ForwardGraph:
        """Static buffers for (bucket, q), holding the padding rows' values."""
        dev, rows = self.device, bucket * q
        scratch = self.scratch_block * self.block_size + torch.arange(q, device=dev) % self.block_size
        padding = {
            "input_ids": torch.zeros(rows, dtype=torch.long, device=dev),
            "positions": torch.zeros(rows, dtype=torch.long, device=dev),
            "query_slots": scratch.repeat(bucket),
            "seq_lens": torch.ones(bucket, dtype=torch.int32, device=dev),
            "kv_start": torch.zeros(bucket, dtype=torch.int32, device=dev),
            "block_table": torch.full((bucket, self.max_blocks), self.scratch_block, dtype=torch.int32, device=dev),
        }
        buffers = {name: value.clone() for name, value in padding.items()}
        return ForwardGraph(replay=lambda: None, output=torch.empty(0), padding=padding, **buffers)

    def static_forward(self, graph: ForwardGraph, key: tuple[int, int, bool],
                       meta: AttentionMetadata) -> Callable[[], torch.Tensor]:
        """The forward over `graph`'s buffers (a whole-step graph captures it with
        the rest of its step, engine/step_graphs.py): its metadata is `meta` with
        every tensor the graph's own and every host bound the key's."""
        bucket, q, has_kv_offset = key
        graph.meta = replace(
            meta,
            query_start_loc=(torch.arange(bucket + 1, device=self.device, dtype=torch.int32) * q),
            seq_lens=graph.seq_lens,
            kv_start=graph.kv_start,
            block_table=graph.block_table,
            query_slots=graph.query_slots,
            query_pages=None,  # derived from the slots inside the graph, at every replay
            query_offsets=None,
            max_query_len=q,
            max_seq_len=self.max_blocks * self.block_size,
            build_groups=list,
            has_kv_offset=has_kv_offset,
        )

        def run() -> torch.Tensor:
            with attention_metadata(graph.meta), self.model_context(len(graph.input_ids)):
                return self.model(graph.input_ids, graph.positions)

        return run
