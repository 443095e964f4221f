"""The attention layer of the diffusion models: non-causal, over the paged KV pool.

Each layer owns one page-structured tensor `[num_blocks, block_size, 2, kv_heads,
head_dim]` carved from the pool vLLM's KV cache manager sizes.  The step's backend
(attention/backends.py) writes the queries' fresh K/V into their slots and attends
over each sequence's K/V read back from the pool: exactly the data flow a Reuse step
needs (fresh block K/V plus cached K/V of the rest), so caching policies only change
which positions are queries.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_dllm.attention import sparse
from vllm_dllm.attention.metadata import current_metadata


def kv_page_shape(block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    return (block_size, 2, num_kv_heads, head_dim)


class DiffusionAttention(nn.Module):
    """Non-causal attention for one layer; heads are this rank's tensor-parallel share."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, prefix: str,
                 over_ranks: sparse.HeadsOverRanks | None = None):
        super().__init__()
        # Under tensor parallelism the KV heads of the other ranks: the sparse cache
        # ranks positions by every head's scores.
        self.over_ranks = over_ranks
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.layer_name = prefix
        self.kv_cache: torch.Tensor | None = None  # [num_blocks, block_size, 2, H_kv, D]

    def bind_kv_cache(self, cache: torch.Tensor | None) -> None:
        self.kv_cache = cache

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = current_metadata()
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if meta.cache_fill is None:
            out = meta.backend.attend(q, k, v, None if meta.in_flight else self.kv_cache, meta, self.scale)
        else:
            out = sparse.attend(q, k, v, self.kv_cache, meta, self.scale, self.over_ranks)
        return out.reshape(-1, self.num_heads * self.head_dim)
