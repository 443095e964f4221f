"""Per-step attention metadata, set by the step engine around each forward pass.

The model's layers are built once; what changes per step (which sequences are in
the batch, which of their positions are queries, where their K/V live in the paged
pool) reaches them through this context, as vLLM's forward context does for its
own backends.  Every field is a tensor over the whole batch: a layer makes one
attention call per step, whatever the number of sequences.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class QueryGroup:
    """Sequences of similar query count and length, attended together in a padded grid.

    A Refresh of a whole sequence and a Reuse of a 32-token block in one padded grid
    would pad the Reuse to the Refresh's length, and a 100-token sequence next to an
    800-token one would read 8x the K/V it needs; grouping sequences by query count
    and by length, each rounded up to a power of two, keeps the padding under 2x in
    both, with at most one group per pair of powers of two (a number of calls that
    does not grow with the batch).

    K/V are read by whole pool blocks: sequence g's grid row is its blocks
    `kv_blocks[g]` laid end to end, and `kv_valid[g]` marks its own positions in
    them (a CFG twin's start inside its first block included).  Attention is not
    causal, so the order of keys in the grid does not matter.
    """

    rows: torch.Tensor | None  # packed query rows of the group, None: all rows, in order
    seq_index: torch.Tensor  # the group's sequences (indices into the step's sequences)
    query_seq: torch.Tensor  # per group row: its sequence within the group
    query_row: torch.Tensor  # per group row: its index among its sequence's queries
    max_query_len: int
    uniform: bool  # every sequence has max_query_len queries: the rows are the grid
    kv_blocks: torch.Tensor  # int64 [G, blocks]: pool blocks holding each sequence's K/V
    kv_valid: torch.Tensor  # bool [G, blocks * block_size]
    # (start, stop) when every sequence's valid columns are exactly that one range (a
    # lone sequence, or sequences of one length and offset): the grid is sliced to it
    # and attends without a mask, which SDPA runs faster.  None: kv_valid masks.
    dense_keys: tuple[int, int] | None = None
    # Every sequence is a whole Refresh (all its positions queries, from position 0)
    # of one length: its keys are its queries' fresh K/V rows, in order.
    keys_are_queries: bool = False


@dataclass
class AttentionMetadata:
    """The packed, varlen layout of one step.

    Sequence s owns query rows `query_start_loc[s]:query_start_loc[s+1]` and attends,
    non-causally, over its positions 0..seq_lens[s]-1.  Position p of sequence s lives
    at logical index i = kv_start[s] + p of its block-table row: pool block
    `block_table[s, i // block_size]`, offset `i % block_size`.  (kv_start is 0 except
    for a classifier-free-guidance twin, which follows its conditional sequence in
    the same blocks.)  `query_slots[t]` is the pool slot of query row t: its fresh K/V
    are written there before attending, in Refresh and Reuse steps alike (a Reuse step
    only ever overwrites its own query positions, which attend with fresh K/V anyway).

    `groups` serve the torch backend (and in-flight attention without a pool):
    padded grids of sequences with similar query counts (QueryGroup), built on first
    use by `build_groups`, so the Triton and flash backends never pay for them.
    """

    query_start_loc: torch.Tensor  # int32 [S + 1]
    seq_lens: torch.Tensor  # int32 [S]
    kv_start: torch.Tensor  # int32 [S]
    block_table: torch.Tensor  # int32 [S, max_blocks]
    query_slots: torch.Tensor  # int64 [T]
    max_query_len: int
    max_seq_len: int
    build_groups: Callable[[], list[QueryGroup]]
    backend: "object"  # the AttentionBackend that serves this step
    has_kv_offset: bool = False  # some kv_start is nonzero (a CFG twin): host-known
    # Every sequence is all queries and attends over its own fresh K/V; no pool is
    # read or written (prompt scoring's masked copies, engine/prompt_scoring.py).
    in_flight: bool = False
    # In flight only: per sequence, the block length of block-causal attention (a
    # query attends the keys of its own block and the blocks before; LLaDA2's prompt
    # copies); 0 for a sequence that attends all its keys.  None: no sequence is
    # block-causal.
    in_flight_blocks: torch.Tensor | None = None
    # Sparse Refresh sequences (attention/sparse.py), after the ones above: this
    # metadata then covers only the rows before `cache_fill.row_start`.
    cache_fill: "object | None" = None
    # query_slots as (pool block, offset in it), computed once for all layers; None:
    # the backends derive them from query_slots (a captured graph does, per replay).
    query_pages: torch.Tensor | None = None
    query_offsets: torch.Tensor | None = None
    _groups: list[QueryGroup] | None = field(default=None, init=False, repr=False)

    @property
    def groups(self) -> list[QueryGroup]:
        if self._groups is None:
            self._groups = self.build_groups()
        return self._groups

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


_current: AttentionMetadata | None = None


def current_metadata() -> AttentionMetadata:
    if _current is None:
        raise RuntimeError("diffusion attention called outside an engine step")
    return _current


@contextlib.contextmanager
def attention_metadata(meta: AttentionMetadata):
    global _current
    previous, _current = _current, meta
    try:
        yield meta
    finally:
        _current = previous
