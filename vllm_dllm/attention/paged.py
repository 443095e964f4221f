"""Bidirectional attention over vLLM's paged KV pool (the torch path, any device).

Each layer owns one page-structured tensor `[num_blocks, block_size, 2, kv_heads,
head_dim]` carved from the pool vLLM's KV cache manager sizes.  A step writes the
fresh K/V of its query positions into their slots, then every query attends over
the sequence's K/V read back from the pool: exactly the data flow a Reuse step needs
(fresh block K/V plus cached K/V of the rest), so caching policies only change which
positions are queries.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm_dllm.attention.context import current_context


def kv_page_shape(block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    return (block_size, 2, num_kv_heads, head_dim)


class DiffusionAttention(nn.Module):
    """Non-causal attention for one layer; heads are this rank's tensor-parallel share."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, prefix: str):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.layer_name = prefix
        self.kv_cache: torch.Tensor | None = None  # [num_blocks, block_size, 2, H_kv, D]

    def bind_kv_cache(self, cache: torch.Tensor) -> None:
        self.kv_cache = cache

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = current_context()
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        out = torch.empty_like(q)
        cache = self.kv_cache
        for seq in ctx.sequences:
            rows = slice(seq.query_start, seq.query_end)
            if cache is None:
                # Profiling and warm-up run before the pool exists: attend to the
                # query rows themselves.
                keys, values = k[rows], v[rows]
            else:
                block_size = cache.shape[1]
                if seq.write_kv:
                    write = seq.kv_slots[seq.query_positions]
                    cache[write // block_size, write % block_size, 0] = k[rows]
                    cache[write // block_size, write % block_size, 1] = v[rows]
                read_blocks, read_offsets = seq.kv_slots // block_size, seq.kv_slots % block_size
                keys = cache[read_blocks, read_offsets, 0]
                values = cache[read_blocks, read_offsets, 1]
                if not seq.write_kv:
                    keys[seq.query_positions] = k[rows]
                    values[seq.query_positions] = v[rows]
            out[rows] = self._attend(q[rows], keys, values)
        return out.view(-1, self.num_heads * self.head_dim)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # [tokens, heads, dim] -> [heads, tokens, dim]
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=False, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads
        )
        return out.transpose(0, 1)
