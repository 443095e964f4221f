"""Triton paged, varlen, non-causal (bidirectional) attention with GQA.

Layout (shared with `vllm_dllm.attention.paged`):

* `kv_cache` `[num_blocks, block_size, 2, num_kv_heads, head_dim]`: one layer's
  page pool; index 0 on dim 2 is K, 1 is V.
* `q` `[T, num_heads, head_dim]`: the query rows of all sequences, packed; sequence
  `s` owns rows `query_start_loc[s]:query_start_loc[s + 1]`.
* Every query of sequence `s` attends over KV positions `0 .. seq_lens[s] - 1` (no
  causal mask).  Position `p` lives at logical index `i = kv_start[s] + p` of the
  sequence's block-table row: pool block `block_table[s, i // block_size]`, offset
  `i % block_size`.  `kv_start` need not be block-aligned (a classifier-free
  guidance twin sits right after its partner in the same blocks), so every KV
  position's slot is gathered individually.
* Query head `h` reads KV head `h // (num_heads // num_kv_heads)`.

One program handles (sequence, tile of BLOCK_M query rows, query head) and streams
the sequence's KV in tiles of BLOCK_N positions with an online (flash-attention)
softmax accumulated in float32.  The output has `q`'s shape and dtype.

This module imports no vLLM and loads without Triton (`HAS_TRITON` is then False
and `paged_attention_triton` raises).
"""

from __future__ import annotations

import functools

import torch

try:  # pragma: no cover - exercised by whether triton is installed
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    triton = None
    tl = None
    HAS_TRITON = False

__all__ = ["HAS_TRITON", "paged_attention_triton", "default_block_sizes"]

_LOG2E = 1.4426950408889634


if HAS_TRITON:

    @triton.jit
    def _paged_attn_fwd(
        Q,
        KV,
        O,
        QUERY_START_LOC,
        SEQ_LENS,
        KV_START,
        BLOCK_TABLE,
        qk_scale,  # softmax scale * log2(e): the kernel works in base 2
        stride_qt,
        stride_qh,
        stride_qd,
        stride_kvb,
        stride_kvs,
        stride_kvc,
        stride_kvh,
        stride_kvd,
        stride_ot,
        stride_oh,
        stride_od,
        stride_bts,
        stride_btb,
        QUERIES_PER_KV: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        IEEE_FP32: tl.constexpr,
        BF16_VIA_FP32: tl.constexpr,
    ):
        seq = tl.program_id(0)
        m_tile = tl.program_id(1)
        head = tl.program_id(2)

        q_start = tl.load(QUERY_START_LOC + seq)
        q_len = tl.load(QUERY_START_LOC + seq + 1) - q_start
        if m_tile * BLOCK_M >= q_len:
            return  # ragged batch: this sequence has fewer query tiles
        seq_len = tl.load(SEQ_LENS + seq)
        kv_start = tl.load(KV_START + seq)
        kv_head = head // QUERIES_PER_KV

        offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        mask_m = offs_m < q_len
        rows = (q_start + offs_m).to(tl.int64)

        q_ptrs = Q + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :] * stride_qd
        q = tl.load(q_ptrs, mask=mask_m[:, None], other=0.0)
        if BF16_VIA_FP32:
            q = q.to(tl.float32)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

        bt_row = BLOCK_TABLE + seq.to(tl.int64) * stride_bts
        kv_head_off = kv_head * stride_kvh
        for start_n in range(0, seq_len, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            mask_n = offs_n < seq_len
            logical = kv_start + offs_n
            page = tl.load(bt_row + (logical // PAGE_SIZE) * stride_btb, mask=mask_n, other=0)
            slot_off = page.to(tl.int64) * stride_kvb + (logical % PAGE_SIZE) * stride_kvs + kv_head_off

            # K loaded transposed, [HEAD_DIM, BLOCK_N]; V as [BLOCK_N, HEAD_DIM].
            k = tl.load(
                KV + slot_off[None, :] + offs_d[:, None] * stride_kvd,
                mask=mask_n[None, :],
                other=0.0,
            )
            v = tl.load(
                KV + stride_kvc + slot_off[:, None] + offs_d[None, :] * stride_kvd,
                mask=mask_n[:, None],
                other=0.0,
            )

            if BF16_VIA_FP32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)

            if IEEE_FP32 or BF16_VIA_FP32:
                qk = tl.dot(q, k, input_precision="ieee")
            else:
                qk = tl.dot(q, k)
            qk = tl.where(mask_n[None, :], qk * qk_scale, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            if IEEE_FP32:
                acc = tl.dot(p, v, acc, input_precision="ieee")
            elif BF16_VIA_FP32:
                # round P to bf16 as the GPU path does, multiply in float32
                acc = tl.dot(p.to(tl.bfloat16).to(tl.float32), v, acc, input_precision="ieee")
            else:
                acc = tl.dot(p.to(v.dtype), v, acc)
            m_i = m_new

        l_i = tl.where(l_i == 0.0, 1.0, l_i)  # seq_len == 0: output zeros, not NaN
        out = acc / l_i[:, None]
        o_ptrs = O + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :] * stride_od
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=mask_m[:, None])


# Triton's interpreter (TRITON_INTERPRET=1, read when @triton.jit runs) keeps bf16
# as raw uint16 bits and its tl.dot multiplies those bits; under it, bf16 operands
# are upcast to float32 (exact) and P is rounded to bf16, as on the GPU path.
_INTERPRETED = HAS_TRITON and type(_paged_attn_fwd).__name__ == "InterpretedFunction"


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


# On an H100 the 128-position KV tile at 3 stages is 1.24-1.28x faster than 64
# positions over every LLaDA-8B Reuse shape measured (head_dim 128 in bf16;
# benchmarks/results/triton-tile-sweep).  It is taken only where it was measured:
# Hopper (compute capability 9.x) and rows of 256 bytes.  Other GPUs keep the
# 64-position tile, unmeasured against it.
_WIDE_KV_TILE = 128
_WIDE_KV_TILE_STAGES = 3
_WIDE_KV_TILE_ROW_BYTES = 256
_WIDE_KV_TILE_CAPABILITY = 9


def default_block_sizes(head_dim: int, max_query_len: int, element_size: int = 2,
                        wide_kv_tile: bool = False) -> tuple[int, int, int | None]:
    """(BLOCK_M, BLOCK_N, num_stages or None for Triton's default) for a GPU.

    Query tiles no taller than the longest query run (but >= 16 for tl.dot), at most
    64.  KV tiles: 128 positions at 3 stages for rows of 256 bytes on a device where
    that was measured (`wide_kv_tile`); else 64, or 32 when a K/V row exceeds 256
    bytes (keeps fp32 head_dim 128 under ~100 KB of shared memory)."""
    block_m = min(64, max(16, _next_pow2(max_query_len)))
    row_bytes = head_dim * element_size
    if wide_kv_tile and row_bytes == _WIDE_KV_TILE_ROW_BYTES:
        return block_m, _WIDE_KV_TILE, _WIDE_KV_TILE_STAGES
    return block_m, 64 if row_bytes <= 256 else 32, None


def _wide_kv_tile(device: torch.device) -> bool:
    if device.type != "cuda" or _INTERPRETED:
        return False
    return _is_hopper(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _is_hopper(index: int) -> bool:
    # Asked once per device: the kernel launches once per layer per step.
    return torch.cuda.get_device_capability(index)[0] == _WIDE_KV_TILE_CAPABILITY


def paged_attention_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_start: torch.Tensor,
    block_table: torch.Tensor,
    max_query_len: int,
    scale: float,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Non-causal paged attention; returns `[T, num_heads, head_dim]` in q's dtype.

    See the module docstring for the layout.  `block_m` / `block_n` override the
    query / KV tile sizes (powers of two, >= 16 for `tl.dot` on GPUs).
    """
    if not HAS_TRITON:
        raise RuntimeError("paged_attention_triton needs triton, which is not installed")
    assert q.dim() == 3, f"q must be [T, num_heads, head_dim], got {tuple(q.shape)}"
    assert kv_cache.dim() == 5 and kv_cache.shape[2] == 2, (
        f"kv_cache must be [num_blocks, block_size, 2, num_kv_heads, head_dim], got {tuple(kv_cache.shape)}"
    )
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, _, num_kv_heads, kv_head_dim = kv_cache.shape
    assert kv_head_dim == head_dim, f"head_dim mismatch: q {head_dim}, kv_cache {kv_head_dim}"
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, f"head_dim must be a power of two >= 16, got {head_dim}"
    assert num_heads % num_kv_heads == 0, f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}"
    assert q.dtype == kv_cache.dtype, f"dtype mismatch: q {q.dtype}, kv_cache {kv_cache.dtype}"
    assert q.dtype in (torch.float32, torch.float16, torch.bfloat16), f"unsupported dtype {q.dtype}"
    num_seqs = seq_lens.shape[0]
    assert query_start_loc.shape == (num_seqs + 1,), "query_start_loc must have num_seqs + 1 entries"
    assert kv_start.shape == (num_seqs,), "kv_start must have num_seqs entries"
    assert block_table.dim() == 2 and block_table.shape[0] == num_seqs, "block_table must be [num_seqs, max_blocks]"
    for name, t in (
        ("query_start_loc", query_start_loc),
        ("seq_lens", seq_lens),
        ("kv_start", kv_start),
        ("block_table", block_table),
    ):
        assert t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}"
        assert t.device == q.device, f"{name} is on {t.device}, q on {q.device}"
    assert kv_cache.device == q.device, f"kv_cache is on {kv_cache.device}, q on {q.device}"
    # The kernel indexes these with unit stride.
    query_start_loc, seq_lens, kv_start = (t.contiguous() for t in (query_start_loc, seq_lens, kv_start))

    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0 or max_query_len <= 0:
        return out

    # A caller's block_n or num_stages keeps the narrow tile's defaults: the wide tile
    # was measured only at its own stage count.
    wide = block_n is None and num_stages is None and _wide_kv_tile(q.device)
    default_m, default_n, default_stages = default_block_sizes(head_dim, max_query_len, q.element_size(), wide)
    if wide:
        num_stages = default_stages
    block_m = block_m or default_m
    block_n = block_n or default_n
    for name, b in (("block_m", block_m), ("block_n", block_n)):
        assert b >= 16 and b & (b - 1) == 0, f"{name} must be a power of two >= 16, got {b}"
    launch_opts = {"num_warps": num_warps or 4}
    if num_stages is not None:
        launch_opts["num_stages"] = num_stages

    grid = (num_seqs, triton.cdiv(max_query_len, block_m), num_heads)
    _paged_attn_fwd[grid](
        q,
        kv_cache,
        out,
        query_start_loc,
        seq_lens,
        kv_start,
        block_table,
        float(scale) * _LOG2E,
        *q.stride(),
        *kv_cache.stride(),
        *out.stride(),
        *block_table.stride(),
        QUERIES_PER_KV=num_heads // num_kv_heads,
        PAGE_SIZE=page_size,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        IEEE_FP32=q.dtype == torch.float32,
        BF16_VIA_FP32=_INTERPRETED and q.dtype == torch.bfloat16,
        **launch_opts,
    )
    return out
