"""Counter-based random numbers for device-side sampling: Philox4x32-10 in torch.

Every random draw of a request is a pure function of (request seed, denoising step,
canvas position, stream, index), so it does not depend on which other requests
share the batch, on how rows are chunked, or on the device.  This module is the
torch reference (vectorised, any device); `vllm_dllm.decoding.triton_philox`
produces the same bits in Triton.  It imports no vLLM.

Contract (enough to reproduce every bit independently)
-------------------------------------------------------
All words are unsigned 32-bit; `+` and `*` on words wrap mod 2**32.

Philox4x32-10, exactly as in Random123 (Salmon, Moraes, Dror, Shaw, "Parallel
random numbers: as easy as 1, 2, 3", SC 2011), with
    M0 = 0xD2511F53, M1 = 0xCD9E8D57 (round multipliers),
    W0 = 0x9E3779B9, W1 = 0xBB67AE85 (Weyl key increments).
Input counter (c0, c1, c2, c3), key (k0, k1).  Ten rounds; one round is
    (hi0, lo0) = high and low words of the 64-bit product M0 * c0
    (hi1, lo1) = high and low words of the 64-bit product M1 * c2
    (c0, c1, c2, c3) = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0)
and between consecutive rounds (nine times; not before the first round, not after
the last) the key is bumped: k0 += W0, k1 += W1.  The output (x0, x1, x2, x3) is
the counter after the tenth round.  Known answers (Random123 tests/kat_vectors):
    ctr 0,0,0,0 key 0,0 -> 6627e8d5 e169c58d bc57ac4c 9b00dbd8
    ctr ffffffff x4 key ffffffff x2 -> 408f276d 41c83b0e a20bc7c6 6d5451fd
    ctr 243f6a88 85a308d3 13198a2e 03707344 key a4093822 299f31d0
        -> d16cfe09 94fdcceb 5001e420 24126ea1

Mapping of a draw to (counter, key):
    s = seed mod 2**64 (negative Python ints / int64 values: two's complement)
    key     = (s mod 2**32, s >> 32)
    counter = (index, position mod 2**32, step mod 2**32, stream mod 2**32)
`index` is the draw's index within its row (a vocabulary id for per-token noise;
0 for a single draw per row), `position` the 0-based canvas position (-1, "the
whole canvas", becomes 0xFFFFFFFF), `step` the denoising step, `stream` a small
integer naming the kind of draw.  The tensor API takes seeds as int64 holding
values in [0, 2**63) (callers reduce larger seeds mod 2**64 and, if needed, map
them into int64 by two's complement: the bits are the same).

Uniforms, strictly inside (0, 1), from the output words:
    float32: m = x0 >> 8 (24 bits); u = float32(m + 0.5) * 2**-24, where float32()
             rounds the exact value to nearest, ties to even (equivalently: convert
             m to float32 exactly, then add 0.5 in float32); then u = min(u, 1 - 2**-24).
    float64: m = (x0 << 21) | (x1 >> 11) (53 bits); u = float64(m + 0.5) * 2**-53,
             rounded to nearest, ties to even; then u = min(u, 1 - 2**-53).
The `min` only changes the largest m (2**24 - 1, resp. 2**53 - 1), whose m + 0.5
would round up to 2**24 (2**53) and give u == 1.0; every other value is exactly
((m + 0.5) * 2**-k) rounded to the format.  The smallest u is 2**-25 (2**-54).

Draws are one per (seed, step, position, stream, index); the decoding rules use them
for inverse-CDF token draws, random remasking confidences, Dream's flips and
alg_temp keys.
"""

from __future__ import annotations

import torch

__all__ = [
    "M0",
    "M1",
    "W0",
    "W1",
    "philox4x32_10",
    "uniform_rows",
    "uniform",
]

M0 = 0xD2511F53
M1 = 0xCD9E8D57
W0 = 0x9E3779B9
W1 = 0xBB67AE85
ROUNDS = 10
MASK32 = 0xFFFFFFFF

# Largest values strictly below 1.0 (the clamp of the contract).
ONE_BELOW_F32 = 1.0 - 2.0**-24
ONE_BELOW_F64 = 1.0 - 2.0**-53

# uniform_rows works on column chunks of at most this many elements (R * chunk), so
# each of its ~6 live int64 intermediates stays at 8 MB even for [R, 126464].
_CHUNK_ELEMENTS = 1 << 20


def _philox_words(c0, c1, c2, c3, k0, k1, words: int = 4):
    """Philox4x32-10 on broadcastable int64 tensors (or ints) holding uint32 values.

    Returns the first `words` output words (1, 2 or 4) at the broadcast shape of all
    inputs.  The counter is materialised once at that shape and updated in place
    (two fresh tensors per round), which keeps large batches lean; with words <= 2
    the last round skips the M0 product, which only feeds words 2 and 3."""
    device = next((t.device for t in (c0, c1, c2, c3, k0, k1) if isinstance(t, torch.Tensor)), None)
    # An int becomes a tensor by a fill, not a copy from the host, which a CUDA graph's
    # capture could not hold.
    c0, c1, c2, c3, k0, k1 = (
        t.to(torch.int64) if isinstance(t, torch.Tensor) else torch.full((), t, dtype=torch.int64, device=device)
        for t in (c0, c1, c2, c3, k0, k1)
    )
    shape = torch.broadcast_shapes(c0.shape, c1.shape, c2.shape, c3.shape, k0.shape, k1.shape)
    c0, c1, c2, c3 = (c.expand(shape).clone() for c in (c0, c1, c2, c3))
    for r in range(ROUNDS):
        if r:
            k0 = (k0 + W0) & MASK32
            k1 = (k1 + W1) & MASK32
        last = r == ROUNDS - 1 and words <= 2
        # M * c wraps in int64 but its low 64 bits are the exact unsigned product, so
        # an arithmetic shift plus mask gives the high word and a mask the low word.
        p1 = c2 * M1
        if not last:
            p0 = c0 * M0
            torch.bitwise_and(p0, MASK32, out=c0)  # lo0: the next c3
        torch.bitwise_and(p1, MASK32, out=c2)  # lo1: the next c1
        p1 >>= 32
        p1 &= MASK32
        p1 ^= c1
        p1 ^= k0  # hi1 ^ c1 ^ k0: the next c0
        if last:
            return (p1,) if words == 1 else (p1, c2)
        p0 >>= 32
        p0 &= MASK32
        p0 ^= c3
        p0 ^= k1  # hi0 ^ c3 ^ k1: the next c2
        c0, c1, c2, c3 = p1, c2, p0, c0
    return (c0, c1, c2, c3)[:words]


def philox4x32_10(counter: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Philox4x32-10 of `counter` [..., 4] under `key` [..., 2] (int64 tensors holding
    uint32 values; other values are reduced mod 2**32); leading dims broadcast.
    Returns int64 [..., 4] holding the uint32 output words."""
    counter = torch.as_tensor(counter, dtype=torch.int64) & MASK32
    key = torch.as_tensor(key, dtype=torch.int64, device=counter.device) & MASK32
    if counter.shape[-1] != 4 or key.shape[-1] != 2:
        raise ValueError(
            f"counter must be [..., 4] and key [..., 2], got {tuple(counter.shape)}, {tuple(key.shape)}"
        )
    c = counter.unbind(-1)
    k = key.unbind(-1)
    return torch.stack(_philox_words(c[0], c[1], c[2], c[3], k[0], k[1], words=4), dim=-1)


def _row_words(seeds, steps, positions, stream: int):
    """Per-row key and counter words 1..3, as [R, 1] int64 columns."""
    seeds = torch.as_tensor(seeds, dtype=torch.int64)
    device = seeds.device
    steps = torch.as_tensor(steps, dtype=torch.int64, device=device)
    positions = torch.as_tensor(positions, dtype=torch.int64, device=device)
    if not (seeds.dim() == steps.dim() == positions.dim() == 1 and len(seeds) == len(steps) == len(positions)):
        raise ValueError(
            "seeds, steps and positions must be 1-D of one length, got "
            f"{tuple(seeds.shape)}, {tuple(steps.shape)}, {tuple(positions.shape)}"
        )
    k0 = (seeds & MASK32)[:, None]
    k1 = ((seeds >> 32) & MASK32)[:, None]  # arithmetic shift: two's complement of mod 2**64
    c1 = (positions & MASK32)[:, None]
    c2 = (steps & MASK32)[:, None]
    c3 = int(stream) & MASK32
    return k0, k1, c1, c2, c3


def _to_uniform(words, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.float32:
        u = ((words[0] >> 8).to(torch.float32) + 0.5) * 2.0**-24
        return u.clamp_(max=ONE_BELOW_F32)
    if dtype == torch.float64:
        m = (words[0] << 21) | (words[1] >> 11)
        u = (m.to(torch.float64) + 0.5) * 2.0**-53
        return u.clamp_(max=ONE_BELOW_F64)
    raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")


def check_uniform_dtype(dtype: torch.dtype) -> None:
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")


def uniform_rows(
    seeds: torch.Tensor,
    steps: torch.Tensor,
    positions: torch.Tensor,
    stream: int,
    n: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Uniforms in (0, 1), `[R, n]` of `dtype` (float32 or float64) on the seeds'
    device: row r holds the draws of index 0 .. n-1 of (seeds[r], steps[r],
    positions[r], stream).  See the module docstring for the exact bits."""
    check_uniform_dtype(dtype)
    k0, k1, c1, c2, c3 = _row_words(seeds, steps, positions, stream)
    rows, device = k0.shape[0], k0.device
    out = torch.empty(rows, n, dtype=dtype, device=device)
    if rows == 0 or n == 0:
        return out
    words = 1 if dtype == torch.float32 else 2
    chunk = max(1, min(n, _CHUNK_ELEMENTS // rows))
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        c0 = torch.arange(start, end, dtype=torch.int64, device=device)[None, :]
        ws = _philox_words(c0, c1, c2, c3, k0, k1, words=words)
        out[:, start:end] = _to_uniform(ws, dtype)
    return out


def uniform(
    seeds: torch.Tensor,
    steps: torch.Tensor,
    positions: torch.Tensor,
    stream: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """One uniform per row (index 0): `uniform_rows(..., n=1)[:, 0]`, shape `[R]`."""
    return uniform_rows(seeds, steps, positions, stream, 1, dtype)[:, 0]
