"""Attention backends: one varlen, non-causal, GQA-aware call per layer per step.

Every backend first writes the queries' fresh K/V into their pool slots (one
scatter), then attends each query over its sequence's K/V in the pool.  Without a
pool (memory profiling and warm-up run before it exists) each sequence attends over
its own in-flight K/V, which is only meaningful when all its positions are queries
(a Refresh).

  torch   the reference and the CPU path: gathers K/V into a padded
          [sequences, max_seq_len] grid and makes one SDPA call with a key mask.
  triton  a paged varlen kernel reading K/V through the block table
          (attention/triton_paged.py); CUDA only, tested on CPU under TRITON_INTERPRET.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from vllm_dllm.attention.metadata import AttentionMetadata, QueryGroup

logger = logging.getLogger(__name__)

BACKENDS = ("torch", "triton")


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    block_size = cache.shape[1]
    cache[slots // block_size, slots % block_size] = torch.stack([k, v], dim=1).to(cache.dtype)


class TorchAttention:
    name = "torch"

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: torch.Tensor | None,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if cache is not None:
            write_kv(cache, k, v, meta.query_slots)
        if len(meta.groups) == 1 and meta.groups[0].rows is None:
            return self._attend_group(q, k, v, cache, meta, meta.groups[0], scale)
        out = torch.empty_like(q)
        for group in meta.groups:
            out[group.rows] = self._attend_group(q[group.rows], k, v, cache, meta, group, scale)
        return out

    def _attend_group(self, q, k, v, cache, meta: AttentionMetadata, group: QueryGroup, scale: float):
        """Attention of one group's query rows (in group order) over their sequences."""
        num_seqs, max_q = len(group.seq_index), group.max_query_len
        if cache is None:
            starts = meta.query_start_loc[group.seq_index].long()
            rows = starts[:, None] + torch.arange(group.kv_valid.shape[1], device=q.device)
            rows = torch.where(group.kv_valid, rows, torch.zeros_like(rows))
            keys, values = k[rows], v[rows]
        else:
            block_size = cache.shape[1]
            kv = cache[group.kv_slots // block_size, group.kv_slots % block_size].to(q.dtype)
            keys, values = kv[:, :, 0], kv[:, :, 1]
        if group.uniform:
            # Every sequence has max_query_len queries: the rows are the grid.
            grid = q.view(num_seqs, max_q, q.shape[1], q.shape[2])
        else:
            grid = q.new_zeros(num_seqs, max_q, q.shape[1], q.shape[2])
            grid[group.query_seq, group.query_row] = q
        # [S, L, H, D] -> [S, H, L, D]
        out = F.scaled_dot_product_attention(
            grid.transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=group.kv_valid[:, None, None, :],
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        if group.uniform:
            return out.transpose(1, 2).reshape(q.shape)
        return out.transpose(1, 2)[group.query_seq, group.query_row]


class TritonAttention:
    name = "triton"

    def __init__(self) -> None:
        self._fallback = TorchAttention()

    def attend(self, q, k, v, cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        from vllm_dllm.attention.triton_paged import paged_attention_triton

        if cache is None:
            return self._fallback.attend(q, k, v, cache, meta, scale)
        write_kv(cache, k, v, meta.query_slots)
        return paged_attention_triton(
            q,
            cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.kv_start,
            meta.block_table,
            meta.max_query_len,
            scale,
        )


def triton_available() -> bool:
    try:
        from vllm_dllm.attention.triton_paged import HAS_TRITON
    except ImportError:
        return False
    return HAS_TRITON


def select_backend(device: torch.device, requested: str | None = None):
    """The backend for `device`: Triton on CUDA when available, torch otherwise.

    `requested` (the server option `attention_backend`) overrides the choice; asking
    for Triton where it cannot run is an error, not a silent fallback.
    """
    if requested is not None and requested not in BACKENDS:
        raise ValueError(f"unknown attention backend {requested!r}; choose one of {', '.join(BACKENDS)}")
    name = requested or ("triton" if device.type == "cuda" and triton_available() else "torch")
    if name == "triton" and not triton_available():
        raise ValueError("attention backend 'triton' needs the triton package")
    if name == "triton" and device.type != "cuda":
        raise ValueError(f"attention backend 'triton' runs on CUDA devices, not {device.type}")
    backend = TritonAttention() if name == "triton" else TorchAttention()
    logger.info("Diffusion attention backend: %s on %s", backend.name, device)
    return backend
