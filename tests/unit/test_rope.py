"""models/rope.py: partial RoPE widths vLLM's CPU kernel cannot take in half precision
(each half of the rotary dimensions not a multiple of 8: a head of 48 with rotary 24,
the trained LLaDA2-format task model's shape) run vLLM's native rotation instead of
killing the worker; every other width keeps the kernel, and both rotate alike."""

from __future__ import annotations

import pytest
import torch
from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config

from vllm_dllm.models.rope import Rotary, cpu_kernel_fits


def reference(positions, x, heads, head_dim, rotary_dim, theta):
    """Neox-style RoPE on the first `rotary_dim` dims of each head, in float64."""
    x = x.double().view(len(positions), heads, head_dim)
    half = rotary_dim // 2
    inv = 1.0 / theta ** (torch.arange(half, dtype=torch.float64) * 2 / rotary_dim)
    angle = positions.double()[:, None] * inv[None, :]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    a, b = x[..., :half], x[..., half:rotary_dim]
    out = x.clone()
    out[..., :half] = a * cos - b * sin
    out[..., half:rotary_dim] = b * cos + a * sin
    return out.view(len(positions), heads * head_dim)


def test_the_cpu_kernel_takes_whole_vectors_of_half_precision_only():
    assert not cpu_kernel_fits(24, torch.bfloat16) and not cpu_kernel_fits(20, torch.float16)
    assert cpu_kernel_fits(32, torch.bfloat16) and cpu_kernel_fits(64, torch.float16)
    assert cpu_kernel_fits(24, torch.float32)


@pytest.mark.parametrize("head_dim,factor", [(48, 0.5), (32, 0.5), (64, 1.0)])
def test_partial_rope_in_bfloat16_rotates_as_the_definition(head_dim, factor):
    # vLLM builds a bf16 model under torch's default dtype bf16: the cos/sin cache too.
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        # custom_ops "all": the CPU kernel, as `vllm serve` on CPU dispatches it.
        with set_current_vllm_config(VllmConfig(compilation_config=CompilationConfig(custom_ops=["all"]))):
            rotary = Rotary(head_dim, max_position=256, rope_theta=10000.0, partial_rotary_factor=factor)
    finally:
        torch.set_default_dtype(before)
    positions = torch.arange(47)
    gen = torch.Generator().manual_seed(head_dim)
    q = torch.randn(47, 4 * head_dim, generator=gen).to(torch.bfloat16)
    k = torch.randn(47, 2 * head_dim, generator=gen).to(torch.bfloat16)
    rotary_dim = int(head_dim * factor)
    want_q = reference(positions, q, 4, head_dim, rotary_dim, 10000.0)
    want_k = reference(positions, k, 2, head_dim, rotary_dim, 10000.0)
    for _ in range(20):  # a server's steps: the kernel's overrun crashed within a few calls
        got_q, got_k = rotary(positions, q.clone(), k.clone())
    # bf16 keeps 8 bits of mantissa: values of a few units agree to ~0.03.
    torch.testing.assert_close(got_q.double(), want_q, rtol=0.02, atol=0.05)
    torch.testing.assert_close(got_k.double(), want_k, rtol=0.02, atol=0.05)
