"""The flash-attention backend's translation of our metadata into vLLM's
`flash_attn_varlen_func` arguments, checked on the CPU against a plain-torch
implementation of that function's documented contract (the CUDA kernel itself
cannot run here), and its fallback where flash-attention's constraints do not fit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_dllm.attention.backends import FlashAttention, TorchAttention
from vllm_dllm.engine.step_inputs import SequenceLayout, build_step_inputs
from tests.unit.test_step_engine import BLOCK_SIZE, IDS


def varlen_contract(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None, seqused_k=None,
                    block_table=None, softmax_scale=None, causal=False):
    """vllm_flash_attn.flash_attn_varlen_func as its docstring defines it: sequence b
    owns q rows cu_seqlens_q[b]:cu_seqlens_q[b+1]; its keys are k rows
    cu_seqlens_k[b]:cu_seqlens_k[b+1] (packed) or, paged, its first seqused_k[b]
    positions, position j at page block_table[b, j // page], offset j % page; KV head
    h serves query heads h * G .. h * G + G - 1."""
    assert not causal and (cu_seqlens_k is None) != (seqused_k is None)
    assert block_table is None or seqused_k is not None
    assert k.stride(-1) == 1 and v.stride(-1) == 1
    out = torch.empty_like(q)
    for b in range(len(cu_seqlens_q) - 1):
        rows = slice(int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]))
        if block_table is None:
            keys = k[int(cu_seqlens_k[b]):int(cu_seqlens_k[b + 1])]
            values = v[int(cu_seqlens_k[b]):int(cu_seqlens_k[b + 1])]
        else:
            j = torch.arange(int(seqused_k[b]))
            page = k.shape[1]
            pages = block_table[b, j // page].long()
            keys, values = k[pages, j % page], v[pages, j % page]
        assert rows.stop - rows.start <= max_seqlen_q and len(keys) <= max_seqlen_k
        group = q.shape[1] // keys.shape[1]
        keys, values = keys.float().repeat_interleave(group, 1), values.float().repeat_interleave(group, 1)
        scores = torch.einsum("thd,khd->thk", q[rows].float(), keys) * softmax_scale
        out[rows] = torch.einsum("thk,khd->thd", scores.softmax(-1), values).to(q.dtype)
    return out


class Spy(TorchAttention):
    calls = 0

    def attend(self, *args, **kwargs):
        Spy.calls += 1
        return super().attend(*args, **kwargs)


def step(layout, dtype, backend, cache=None):
    torch.manual_seed(0)
    heads, kv_heads, dim, capacity = 4, 2, 16, 3
    block_table = (torch.randperm(47)[:24] + 1).view(capacity, 8).int()  # shuffled, never block 0
    inputs = build_step_inputs(
        layout, prompt_tokens=torch.zeros(capacity, 64, dtype=torch.long), prompt_len=torch.full((capacity,), 10),
        canvas=torch.zeros(capacity, 64, dtype=torch.long), block_table=block_table, block_size=BLOCK_SIZE,
        mask_id=IDS.mask, backend=backend,
    )
    total = int(layout.num_queries.sum())
    q = torch.randn(total, heads, dim, dtype=dtype)
    k, v = torch.randn(total, kv_heads, dim, dtype=dtype), torch.randn(total, kv_heads, dim, dtype=dtype)
    pool = None if cache is False else torch.randn(48, BLOCK_SIZE, 2, kv_heads, dim, dtype=dtype)
    ref_pool = None if pool is None else pool.clone()
    got = backend.attend(q, k, v, pool, inputs.metadata, 0.25)
    expected = TorchAttention().attend(q, k, v, ref_pool, inputs.metadata, 0.25)
    return got, expected, pool, ref_pool


RAGGED = SequenceLayout(  # a Refresh, a Reuse block, a one-query Reuse: GQA, ragged
    slot=np.array([0, 1, 2]), twin=np.zeros(3, dtype=bool), query_start=np.array([0, 20, 5]),
    num_queries=np.array([37, 8, 1]), seq_len=np.array([37, 45, 50]), kv_start=np.zeros(3, dtype=np.int64),
)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_paged_call_matches_the_torch_backend(dtype):
    Spy.calls = 0
    got, expected, pool, ref_pool = step(RAGGED, dtype, FlashAttention(varlen_contract, fallback=Spy()))
    assert Spy.calls == 0
    assert torch.equal(pool, ref_pool)  # the queries' K/V were written first, the same way
    # Half-precision inputs, float32 maths in both: only the output rounding differs.
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)


def test_refresh_without_a_pool_attends_over_its_in_flight_kv():
    refresh = SequenceLayout(
        slot=np.array([0, 1]), twin=np.zeros(2, dtype=bool), query_start=np.zeros(2, dtype=np.int64),
        num_queries=np.array([37, 12]), seq_len=np.array([37, 12]), kv_start=np.zeros(2, dtype=np.int64),
    )
    Spy.calls = 0
    got, expected, _, _ = step(refresh, torch.bfloat16, FlashAttention(varlen_contract, fallback=Spy()), cache=False)
    assert Spy.calls == 0
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("case", ["cfg twin", "float32"])
def test_steps_outside_its_constraints_go_to_the_fallback(case):
    def refuse(**kwargs):
        raise AssertionError("flash-attention called outside its constraints")

    layout, dtype = RAGGED, torch.bfloat16
    if case == "cfg twin":  # flash-attention has no per-sequence KV offset
        layout = SequenceLayout(
            slot=np.array([0, 1, 1]), twin=np.array([False, False, True]), query_start=np.array([0, 20, 20]),
            num_queries=np.array([37, 8, 8]), seq_len=np.array([37, 45, 45]), kv_start=np.array([0, 0, 45]),
        )
    else:
        dtype = torch.float32
    Spy.calls = 0
    got, expected, _, _ = step(layout, dtype, FlashAttention(refuse, fallback=Spy()))
    assert Spy.calls == 1
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_sparse_reuse_over_packed_slots_matches_the_torch_backend():
    """A sparse Reuse (its queries written after 12 kept slots, attending over kept +
    block) next to a dense one: the same paged call, only the lengths and slots differ."""
    layout = SequenceLayout(
        slot=np.array([0, 1]), twin=np.zeros(2, dtype=bool), query_start=np.array([20, 23]),
        num_queries=np.array([8, 9]), seq_len=np.array([45, 21]), kv_start=np.zeros(2, dtype=np.int64),
        slot_start=np.array([20, 12]),
    )
    Spy.calls = 0
    got, expected, pool, ref_pool = step(layout, torch.bfloat16, FlashAttention(varlen_contract, fallback=Spy()))
    assert Spy.calls == 0
    assert torch.equal(pool, ref_pool)
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("reason", [None, "FA2 is only supported on devices with compute capability >= 8"])
def test_flash_is_offered_only_where_its_kernels_run(monkeypatch, reason):
    """On a GPU older than Ampere vLLM's FA2 refuses to run: the backend choice must
    fall to Triton at start-up rather than fail in the first attention call."""
    import sys
    import types

    from vllm_dllm.attention import backends

    def varlen(*args, **kwargs):
        raise AssertionError("not called here")

    fake = types.ModuleType("vllm.vllm_flash_attn")
    fake.flash_attn_varlen_func = varlen
    fake.fa_version_unsupported_reason = lambda version: reason if version == 2 else "asked for another version"
    monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert backends.load_flash_attn() is (varlen if reason is None else None)


def test_the_paged_backends_never_build_the_torch_backends_groups():
    """Grouping sequences into padded grids is host work plus copies every step;
    only the torch backend reads the groups, so they are built on its first use."""
    capacity, heads, kv_heads, dim = 3, 4, 2, 16
    inputs = build_step_inputs(
        RAGGED, prompt_tokens=torch.zeros(capacity, 64, dtype=torch.long), prompt_len=torch.full((capacity,), 10),
        canvas=torch.zeros(capacity, 64, dtype=torch.long),
        block_table=(torch.arange(24) + 1).view(capacity, 8).int(), block_size=BLOCK_SIZE, mask_id=IDS.mask,
        backend=None,
    )
    total = int(RAGGED.num_queries.sum())
    q = torch.randn(total, heads, dim, dtype=torch.bfloat16)
    k, v = (torch.randn(total, kv_heads, dim, dtype=torch.bfloat16) for _ in range(2))
    pool = torch.randn(32, BLOCK_SIZE, 2, kv_heads, dim, dtype=torch.bfloat16)
    FlashAttention(varlen_contract, fallback=Spy()).attend(q, k, v, pool, inputs.metadata, 0.25)
    assert inputs.metadata._groups is None
    TorchAttention().attend(q, k, v, pool, inputs.metadata, 0.25)
    assert inputs.metadata._groups
