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
  flash   vLLM's bundled flash-attention varlen kernel with block tables, where its
          constraints fit (fp16/bf16, head_dim a multiple of 8 up to 256, pages of a
          multiple of 16, no CFG twin: it has no per-sequence KV offset); any other
          step goes to the Triton backend.  Optional: the engine runs without vLLM.

`graph_safe` backends read only the metadata's tensors and its query count, so a
step can be captured in a CUDA graph and replayed with new inputs (engine/graphs.py).
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from vllm_dllm.attention.metadata import AttentionMetadata, QueryGroup
from vllm_dllm.log import get_logger

logger = get_logger(__name__)

BACKENDS = ("torch", "triton", "flash")
FLASH_ATTN_VERSION = 2  # flash_attn_varlen_func's default, the version we call


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    block_size = cache.shape[1]
    cache[slots // block_size, slots % block_size] = torch.stack([k, v], dim=1).to(cache.dtype)


def write_step_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
    """write_kv at the step's query slots, with their pool blocks and offsets computed
    once for every layer when the metadata carries them."""
    if meta.query_pages is None:
        write_kv(cache, k, v, meta.query_slots)
    elif cache.is_contiguous():
        # One index over the pool's slots: half the time of the (block, offset) pair.
        cache.view(-1, *cache.shape[2:]).index_copy_(0, meta.query_slots, torch.stack([k, v], dim=1).to(cache.dtype))
    else:
        cache[meta.query_pages, meta.query_offsets] = torch.stack([k, v], dim=1).to(cache.dtype)


class TorchAttention:
    name = "torch"
    graph_safe = False  # its padded groups are built on the host for each step

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
            write_step_kv(cache, k, v, meta)
        if len(meta.groups) == 1 and meta.groups[0].rows is None:
            return self._attend_group(q, k, v, cache, meta, meta.groups[0], scale)
        out = torch.empty_like(q)
        for group in meta.groups:
            out[group.rows] = self._attend_group(q[group.rows], k, v, cache, meta, group, scale)
        return out

    def _attend_group(self, q, k, v, cache, meta: AttentionMetadata, group: QueryGroup, scale: float):
        """Attention of one group's query rows (in group order) over their sequences."""
        num_seqs, max_q = len(group.seq_index), group.max_query_len
        # Whole Refreshes of one length read their keys from the rows just written (the
        # pool's values only where it keeps them in the queries' dtype).
        fresh_keys = cache is not None and group.keys_are_queries and cache.dtype == k.dtype
        if cache is None:
            # No pool: a Refresh's own in-flight K/V (kv_start is 0, so the valid
            # columns are the sequence's positions in order).
            starts = meta.query_start_loc[group.seq_index].long()
            rows = starts[:, None] + torch.arange(group.kv_valid.shape[1], device=q.device)
            rows = torch.where(group.kv_valid, rows, torch.zeros_like(rows))
            keys, values = k[rows], v[rows]
        elif fresh_keys:  # in position order; no copy of the pool's pages
            keys, values = (x if group.rows is None else x[group.rows] for x in (k, v))
            keys, values = keys.view(num_seqs, -1, *k.shape[1:]), values.view(num_seqs, -1, *v.shape[1:])
        else:
            # Whole blocks: one contiguous page per index, not one row per position.
            pages = cache.index_select(0, group.kv_blocks.flatten()).to(q.dtype)
            kv = pages.view(num_seqs, -1, *cache.shape[2:])
            if group.dense_keys is not None:
                kv = kv[:, group.dense_keys[0] : group.dense_keys[1]]
            keys, values = kv[:, :, 0], kv[:, :, 1]
        if group.uniform:
            # Every sequence has max_query_len queries: the rows are the grid.
            grid = q.view(num_seqs, max_q, q.shape[1], q.shape[2])
        else:
            grid = q.new_zeros(num_seqs, max_q, q.shape[1], q.shape[2])
            grid[group.query_seq, group.query_row] = q
        # [S, L, H, D] -> [S, H, L, D]
        unmasked = fresh_keys or (cache is not None and group.dense_keys is not None)
        mask = None if unmasked else group.kv_valid[:, None, None, :]
        if cache is None and meta.in_flight_blocks is not None:
            mask = mask & _block_causal(meta.in_flight_blocks[group.seq_index], max_q, keys.shape[1])[:, None]
        out = F.scaled_dot_product_attention(
            grid.transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=mask,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        if group.uniform:
            return out.transpose(1, 2).reshape(q.shape)
        return out.transpose(1, 2)[group.query_seq, group.query_row]


def _block_causal(block_length: torch.Tensor, queries: int, keys: int) -> torch.Tensor:
    """bool [S, queries, keys]: in-flight sequence s's query q (at position q) may
    attend key k when k's block is not after q's (block_length[s] == 0: always)."""
    blocks = block_length.clamp(min=1)[:, None]
    query_block = torch.arange(queries, device=blocks.device)[None, :] // blocks
    key_block = torch.arange(keys, device=blocks.device)[None, :] // blocks
    return (key_block[:, None, :] <= query_block[:, :, None]) | (block_length == 0)[:, None, None]


class TritonAttention:
    name = "triton"
    graph_safe = True

    def __init__(self) -> None:
        self._fallback = TorchAttention()

    def attend(self, q, k, v, cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        from vllm_dllm.attention.triton_paged import paged_attention_triton

        if cache is None:
            return self._fallback.attend(q, k, v, cache, meta, scale)
        write_step_kv(cache, k, v, meta)
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


class FlashAttention:
    """vLLM's flash-attention varlen kernel over the paged pool.

    `varlen_fn` follows `vllm.vllm_flash_attn.flash_attn_varlen_func`: paged K/V as
    `[num_blocks, block_size, kv_heads, head_dim]` views (ours interleave K and V in
    one page, so the views are strided, last dimension contiguous), `seqused_k` and
    `block_table` per sequence, or `cu_seqlens_k` for K/V passed packed.
    """

    name = "flash"
    graph_safe = True

    def __init__(self, varlen_fn, fallback=None) -> None:
        self.varlen_fn = varlen_fn
        self.fallback = fallback if fallback is not None else TritonAttention()

    @staticmethod
    def fits(q: torch.Tensor, cache: torch.Tensor | None, meta: AttentionMetadata) -> bool:
        head_dim = q.shape[-1]
        return (
            q.dtype in (torch.float16, torch.bfloat16)
            and head_dim % 8 == 0
            and head_dim <= 256
            and not meta.has_kv_offset
            and (cache is None or (cache.dtype == q.dtype and cache.shape[1] % 16 == 0))
            and meta.in_flight_blocks is None  # block-causal copies: the torch grid's mask
        )

    def attend(self, q, k, v, cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if not self.fits(q, cache, meta):
            return self.fallback.attend(q, k, v, cache, meta, scale)
        if cache is None:
            # Without a pool every position is a query (a profiling Refresh): the
            # in-flight K/V are the sequences' whole K/V, packed like the queries.
            return self.varlen_fn(
                q=q, k=k, v=v, max_seqlen_q=meta.max_query_len, cu_seqlens_q=meta.query_start_loc,
                max_seqlen_k=meta.max_query_len, cu_seqlens_k=meta.query_start_loc,
                softmax_scale=scale, causal=False,
            )
        write_step_kv(cache, k, v, meta)
        return self.varlen_fn(
            q=q, k=cache[:, :, 0], v=cache[:, :, 1], max_seqlen_q=meta.max_query_len,
            cu_seqlens_q=meta.query_start_loc, max_seqlen_k=meta.max_seq_len, seqused_k=meta.seq_lens,
            block_table=meta.block_table, softmax_scale=scale, causal=False,
        )


def triton_available() -> bool:
    try:
        from vllm_dllm.attention.triton_paged import HAS_TRITON
    except ImportError:
        return False
    return HAS_TRITON


def load_flash_attn():
    """vLLM's bundled `flash_attn_varlen_func`, or None where it cannot run (no vLLM,
    a CPU build, no CUDA, a GPU its FA2 kernels do not support: before Ampere)."""
    if not torch.cuda.is_available():
        return None
    try:
        from vllm.vllm_flash_attn import fa_version_unsupported_reason, flash_attn_varlen_func
    except Exception:  # ImportError, or its CUDA extension failing to load
        return None
    reason = fa_version_unsupported_reason(FLASH_ATTN_VERSION)
    if reason is not None:
        logger.info("vLLM's flash-attention %d cannot run here (%s)", FLASH_ATTN_VERSION, reason)
        return None
    return flash_attn_varlen_func


def select_backend(device: torch.device, requested: str | None = None):
    """The backend for `device`: on CUDA flash-attention where vLLM's build has it,
    else Triton; torch elsewhere.

    `requested` (the server option `attention_backend`) overrides the choice; asking
    for a backend where it cannot run is an error, not a silent fallback.
    """
    if requested is not None and requested not in BACKENDS:
        raise ValueError(f"unknown attention backend {requested!r}; choose one of {', '.join(BACKENDS)}")
    if requested in ("triton", "flash") and device.type != "cuda":
        raise ValueError(f"attention backend {requested!r} runs on CUDA devices, not {device.type}")
    if requested in ("triton", "flash") and not triton_available():
        raise ValueError(f"attention backend {requested!r} needs the triton package (its fallback for CFG twins)")
    flash = load_flash_attn() if device.type == "cuda" and requested in (None, "flash") else None
    if requested == "flash" and flash is None:
        raise ValueError("attention backend 'flash' needs vLLM's CUDA build (vllm.vllm_flash_attn)")
    if requested is not None:
        name = requested
    elif device.type == "cuda" and triton_available():
        name = "flash" if flash is not None else "triton"
    else:
        name = "torch"
    backend = {"torch": TorchAttention, "triton": TritonAttention}.get(name)
    backend = FlashAttention(flash) if name == "flash" else backend()
    logger.info("Diffusion attention backend: %s on %s", backend.name, device)
    return backend
