"""Philox4x32-10 uniforms in Triton: the bits of `vllm_dllm.decoding.philox` (whose
docstring holds the contract), computed on device.

* `uniform_rows_triton(seeds, steps, positions, stream, n, dtype)` returns exactly
  the tensor `philox.uniform_rows` returns (same bits, float32 or float64).

Triton reads TRITON_INTERPRET when `@triton.jit` decorates the kernels, i.e. when
this module is first imported; under the interpreter the functions take CPU
tensors.  The module imports no vLLM and loads without Triton (`HAS_TRITON` is then
False and the functions raise).
"""

from __future__ import annotations

import torch

from vllm_dllm.decoding.philox import M0, M1, MASK32, W0, W1, check_uniform_dtype

try:  # pragma: no cover - depends on whether triton is installed
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    triton = None
    tl = None
    HAS_TRITON = False

# HAS_TRITON: Triton is installed and the kernel serves sampling (decoding/sampling.py
# reads it at each draw); disable() clears it when the start-up self-check
# (worker/self_check.py) finds the kernel disagreeing with the torch Philox.  The
# kernel itself stays callable while Triton is installed.
TRITON_INSTALLED = HAS_TRITON
disabled_reason: str | None = None

__all__ = ["HAS_TRITON", "disable", "uniform_rows_triton"]


def disable(reason: str) -> None:
    """Sampling draws with the torch Philox from now on, in this process."""
    global HAS_TRITON, disabled_reason
    HAS_TRITON, disabled_reason = False, reason

_UNIFORM_BLOCK = 1024


if HAS_TRITON:
    # Kernels may only read globals that are constexpr.
    _M0 = tl.constexpr(M0)
    _M1 = tl.constexpr(M1)
    _W0 = tl.constexpr(W0)
    _W1 = tl.constexpr(W1)

    @triton.jit
    def _philox_x01(c0, c1, c2, c3, k0, k1):
        """Words 0 and 1 of Philox4x32-10; all arguments uint32 (broadcastable)."""
        for r in tl.static_range(10):
            if r > 0:
                k0 = k0 + _W0  # uint32: wraps mod 2**32
                k1 = k1 + _W1
            hi1 = tl.umulhi(c2, _M1)
            lo1 = c2 * _M1
            if r < 9:
                hi0 = tl.umulhi(c0, _M0)
                lo0 = c0 * _M0
                c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
            else:
                c0, c1 = hi1 ^ c1 ^ k0, lo1
        return c0, c1

    @triton.jit
    def _row_key_counter(row, seeds_ptr, steps_ptr, positions_ptr):
        seed = tl.load(seeds_ptr + row)  # int64; truncation to uint32 = mod 2**32
        k0 = seed.to(tl.uint32)
        k1 = (seed >> 32).to(tl.uint32)
        c1 = tl.load(positions_ptr + row).to(tl.uint32)
        c2 = tl.load(steps_ptr + row).to(tl.uint32)
        return k0, k1, c1, c2

    @triton.jit
    def _uniform32(x0):
        u = ((x0 >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08  # 2**-24
        return tl.minimum(u, 0.99999994039535522)  # 1 - 2**-24, exact in fp32

    @triton.jit
    def _uniform64(x0, x1):
        m = (x0.to(tl.uint64) << 21) | (x1 >> 11).to(tl.uint64)
        u = (m.to(tl.float64) + 0.5) * 1.1102230246251565e-16  # 2**-53, exact in fp32 too
        # Only m = 2**53 - 1 rounds to 1.0; it becomes 1 - 2**-53 (computed in fp64,
        # as a literal 1 - 2**-53 would pass through fp32 and round back to 1.0).
        return tl.where(u < 1.0, u, u - 1.1102230246251565e-16)

    @triton.jit
    def _uniform_rows_kernel(
        out_ptr,
        seeds_ptr,
        steps_ptr,
        positions_ptr,
        n,
        stride_out,
        STREAM: tl.constexpr,
        F64: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        k0, k1, c1, c2 = _row_key_counter(row, seeds_ptr, steps_ptr, positions_ptr)
        c0 = offs.to(tl.uint32)
        c3 = tl.full([BLOCK], STREAM, tl.uint32)
        x0, x1 = _philox_x01(c0, c1, c2, c3, k0, k1)
        dst = out_ptr + row.to(tl.int64) * stride_out + offs
        if F64:
            tl.store(dst, _uniform64(x0, x1), mask=mask)
        else:
            tl.store(dst, _uniform32(x0), mask=mask)


# TRITON_INTERPRET=1 at import: kernels run in Triton's interpreter on CPU tensors.
_INTERPRETED = HAS_TRITON and type(_uniform_rows_kernel).__name__ == "InterpretedFunction"


def _require_triton(device: torch.device | None = None) -> None:
    if not TRITON_INSTALLED:
        raise RuntimeError("vllm_dllm.decoding.triton_philox needs triton, which is not installed")
    if device is not None and device.type == "cpu" and not _INTERPRETED:
        raise ValueError(
            "CPU tensors need Triton's interpreter (TRITON_INTERPRET=1 when this module is "
            "first imported); use vllm_dllm.decoding.philox on CPU"
        )


def _row_tensors(seeds, steps, positions, device, rows: int | None = None):
    seeds = torch.as_tensor(seeds, dtype=torch.int64, device=device).contiguous()
    steps = torch.as_tensor(steps, dtype=torch.int64, device=device).contiguous()
    positions = torch.as_tensor(positions, dtype=torch.int64, device=device).contiguous()
    rows = len(seeds) if rows is None else rows
    if not (seeds.shape == steps.shape == positions.shape == (rows,)):
        raise ValueError(
            f"seeds, steps and positions must be [{rows}], got "
            f"{tuple(seeds.shape)}, {tuple(steps.shape)}, {tuple(positions.shape)}"
        )
    return seeds, steps, positions


def uniform_rows_triton(
    seeds: torch.Tensor,
    steps: torch.Tensor,
    positions: torch.Tensor,
    stream: int,
    n: int,
    dtype: torch.dtype = torch.float32,
    *,
    block: int | None = None,
) -> torch.Tensor:
    """`philox.uniform_rows` in Triton: `[R, n]` uniforms in (0, 1), same bits.
    `block` (a power of two) overrides the number of indices per program."""
    _require_triton()
    check_uniform_dtype(dtype)
    seeds = torch.as_tensor(seeds, dtype=torch.int64)
    _require_triton(seeds.device)
    seeds, steps, positions = _row_tensors(seeds, steps, positions, seeds.device)
    if n >= 1 << 31:
        raise ValueError("n must be < 2**31 (indices are int32 in the kernel)")
    rows = len(seeds)
    out = torch.empty(rows, n, dtype=dtype, device=seeds.device)
    if rows == 0 or n == 0:
        return out
    block = block or min(_UNIFORM_BLOCK, triton.next_power_of_2(n))
    grid = (rows, triton.cdiv(n, block))
    _uniform_rows_kernel[grid](
        out,
        seeds,
        steps,
        positions,
        n,
        out.stride(0),
        STREAM=int(stream) & MASK32,
        F64=dtype == torch.float64,
        BLOCK=block,
    )
    return out
