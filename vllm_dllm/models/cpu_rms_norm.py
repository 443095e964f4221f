"""vLLM's C++ RMSNorm for the CPU, offered to vLLM's IR op dispatch.

vLLM (0.32, 0.33) registers its C++ RMSNorm kernels as the `vllm_c` provider of
`vllm.ir.ops.rms_norm` / `fused_add_rms_norm` for GPU-like platforms only, so on the
CPU every `RMSNorm` runs the native torch formula: six dispatched ops with float32
temporaries.  Measured on a 2-core Xeon: ~20 us for an [8, 192] block against 2.3 us
for the kernel vLLM's CPU build ships (`torch.ops._C.rms_norm`), and ~1 ms against
0.14 ms for a [5000, 192] Refresh; nine norms a forward on a 4-layer model.

We register that kernel as provider `dllm_cpu` through `register_impl`, the way vLLM
adds providers, and the config hook puts it first in `kernel_config.ir_op_priority` on
the CPU unless the user chose a priority (`--ir-op-priority`).  It takes only what the
kernel reads correctly: contiguous rows of a width divisible by its vector of 8, a
weight of the input's dtype and width, a residual of the input's shape, no variance
override, and bfloat16 only from vLLM's AVX-512-BF16 build (its AVX2 and AVX-512
builds, loaded on CPUs without AVX-512-BF16 such as AMD Zen 2/3, convert float32 to
bfloat16 by truncation where torch rounds to nearest).  Anything else falls through to
the next provider, vLLM's native one.  The kernel rounds to the dtype in other places
than the native formula does: a few units in the last place (the tolerance is in
tests/unit/test_cpu_rms_norm.py).  Registering loads vLLM's C++ ops in each process that
loads the plugin (the workers load them anyway).
"""

import torch
from torch import Tensor

# No `from __future__ import annotations`: vLLM's IR infers a torch op schema from the
# implementations' annotations, which must be real types.

PROVIDER = "dllm_cpu"
OPS = ("rms_norm", "fused_add_rms_norm")
_VECTOR = 8  # the kernel's elements per vector, every dtype: it refuses other widths
_dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16)  # bfloat16 added by register() where it rounds


def takes_dtype(dtype: torch.dtype) -> bool:
    return dtype in _dtypes


def _rounds_bfloat16_to_nearest() -> bool:
    from vllm.platforms import CpuArchEnum, current_platform

    return current_platform.get_cpu_architecture() == CpuArchEnum.X86 and torch.cpu._is_avx512_bf16_supported()


def _takes(x: torch.Tensor, weight: torch.Tensor | None, variance_size: int | None) -> bool:
    return (
        variance_size is None
        and weight is not None
        and x.device.type == "cpu"
        and x.dtype in _dtypes
        and weight.dtype == x.dtype
        and x.is_contiguous()
        and x.numel() > 0
        and x.shape[-1] % _VECTOR == 0
        and weight.shape == x.shape[-1:]
        and weight.is_contiguous()
    )


def _rms_norm_args(x, weight, epsilon, variance_size=None) -> bool:
    return _takes(x, weight, variance_size)


def _fused_add_args(x, x_residual, weight, epsilon, variance_size=None) -> bool:
    return (
        _takes(x, weight, variance_size)
        and x_residual.shape == x.shape
        and x_residual.dtype == x.dtype
        and x_residual.is_contiguous()
    )


def _rms_norm(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
    out = torch.empty_like(x)
    torch.ops._C.rms_norm(out, x, weight, epsilon)
    return out


def _fused_add_rms_norm(
    x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None
) -> tuple[Tensor, Tensor]:
    torch.ops._C.fused_add_rms_norm(x, x_residual, weight, epsilon)
    return x, x_residual


def register() -> None:
    """Idempotent: every vLLM process (front end, engine core, workers) loads the
    plugin and must know the provider before it reads a priority that names it."""
    global _dtypes
    from vllm import ir
    from vllm.platforms import current_platform

    if PROVIDER in ir.ops.rms_norm.impls:
        return
    on_cpu = current_platform.is_cpu()
    if on_cpu:
        from vllm import _custom_ops  # noqa: F401  loads vLLM's C++ ops (torch.ops._C)

        on_cpu = all(hasattr(torch.ops._C, op) for op in OPS)  # vLLM only warns when they fail to load
        if _rounds_bfloat16_to_nearest():
            _dtypes = (*_dtypes, torch.bfloat16)
    ir.ops.rms_norm.register_impl(PROVIDER, supports_args=_rms_norm_args, supported=on_cpu)(_rms_norm)
    ir.ops.fused_add_rms_norm.register_impl(
        PROVIDER, supports_args=_fused_add_args, supported=on_cpu, inplace=True
    )(_fused_add_rms_norm)


def prefer_on_cpu(kernel_config) -> bool:
    """Put the provider first for both norms unless the user set their priority;
    vLLM then appends the platform's (native) after it.  Returns whether it did."""
    priority = kernel_config.ir_op_priority
    if any(getattr(priority, op) for op in OPS):
        return False
    for op in OPS:
        setattr(priority, op, [PROVIDER])
    return True
