"""Per-step attention metadata, set by the runner around each forward pass.

The model's layers are built once; what changes per step (which sequences are in
the batch, which of their positions are queries, where their K/V live in the paged
pool) reaches them through this context, as vLLM's forward context does for its
own backends.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass
class SequenceSlice:
    """One sequence of the packed batch.

    Rows `query_start:query_end` of the packed query tensor belong to this sequence;
    they sit at sequence positions `query_positions`.  `kv_slots[p]` is the paged-pool
    slot of position p, for every position 0..seq_len-1.  With `write_kv` the fresh
    K/V of the queries go into the pool; without, the queries attend over the pool's
    K/V with their own fresh K/V in place of the cached ones.
    """

    query_start: int
    query_end: int
    query_positions: torch.Tensor
    kv_slots: torch.Tensor
    write_kv: bool = True  # Refresh writes its K/V; Reuse reads the pool only

    @property
    def seq_len(self) -> int:
        return len(self.kv_slots)


@dataclass
class AttentionContext:
    sequences: list[SequenceSlice]


_current: AttentionContext | None = None


def current_context() -> AttentionContext:
    if _current is None:
        raise RuntimeError("diffusion attention called outside a runner step")
    return _current


@contextlib.contextmanager
def attention_context(ctx: AttentionContext):
    global _current
    previous, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = previous
