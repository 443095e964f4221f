"""Rotary position embeddings: vLLM's (`get_rope`), with its native implementation for
the one shape its CPU kernel cannot take.

vLLM's CPU rotary kernel (csrc/cpu/pos_encoding.cpp, vLLM 0.32) writes bf16/fp16 in
vectors of 8 over each half of the rotary dimensions; a half of any other width (a
small model's partial RoPE: head 48, rotary 24) overruns and kills the worker with a
segfault.  Such shapes run vLLM's own `forward_native` instead: the same rotation in
plain torch.  Every other shape, and every shape off the CPU, keeps the kernel.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.platforms import current_platform

# The CPU kernel's vector width over each half of the rotary dimensions (half types).
_CPU_HALF_VECTOR = 8


def cpu_kernel_fits(rotary_dim: int, dtype: torch.dtype) -> bool:
    """Whether vLLM's CPU rotary kernel takes this rotary width in this dtype."""
    return dtype == torch.float32 or (rotary_dim // 2) % _CPU_HALF_VECTOR == 0


class Rotary(nn.Module):
    def __init__(self, head_dim: int, max_position: int, rope_theta: float, partial_rotary_factor: float = 1.0):
        super().__init__()
        self.rope = get_rope(
            head_dim,
            max_position=max_position,
            is_neox_style=True,
            rope_parameters={"rope_type": "default", "rope_theta": rope_theta,
                             "partial_rotary_factor": partial_rotary_factor},
        )
        self.on_cpu = current_platform.is_cpu()

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.on_cpu and not cpu_kernel_fits(self.rope.rotary_dim, q.dtype):
            return self.rope.forward_native(positions, q, k)
        return self.rope(positions, q, k)
