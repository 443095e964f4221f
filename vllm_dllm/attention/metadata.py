"""Per-step attention metadata, set by the step engine around each forward pass.

The model's layers are built once; what changes per step (which sequences are in
the batch, which of their positions are queries, where their K/V live in the paged
pool) reaches them through this context, as vLLM's forward context does for its
own backends.  Every field is a tensor over the whole batch: a layer makes one
attention call per step, whatever the number of sequences.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


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

    The padded index views serve the torch backend: `query_seq`/`query_row` place each
    packed row in a [num_seqs, max_query_len] grid, `kv_slots`/`kv_valid` gather each
    sequence's K/V into a [num_seqs, max_seq_len] grid.
    """

    query_start_loc: torch.Tensor  # int32 [S + 1]
    seq_lens: torch.Tensor  # int32 [S]
    kv_start: torch.Tensor  # int32 [S]
    block_table: torch.Tensor  # int32 [S, max_blocks]
    query_slots: torch.Tensor  # int64 [T]
    max_query_len: int
    max_seq_len: int
    query_seq: torch.Tensor  # int64 [T]
    query_row: torch.Tensor  # int64 [T]
    kv_slots: torch.Tensor  # int64 [S, max_seq_len], clamped to a valid slot where padded
    kv_valid: torch.Tensor  # bool [S, max_seq_len]
    backend: "object"  # the AttentionBackend that serves this step

    @property
    def uniform_queries(self) -> bool:
        """Every sequence has max_query_len queries (host-known, no sync)."""
        return len(self.query_seq) == self.num_seqs * self.max_query_len

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
