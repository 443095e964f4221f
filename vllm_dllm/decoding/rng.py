"""Counter-based random streams for diffusion decoding.

Every random draw of a request is keyed by (request seed, denoising step, canvas
position, stream), never by a shared generator.  The draws of one request are then
independent of which other requests share its batch, of how the masked rows are
chunked for the LM head, and of which rows are still masked: the property that makes
seeded sampling reproducible under batching.

The contract (the test oracle implements it independently):
    key = splitmix64(seed mod 2**64)
    for part in (step, position, stream): key = splitmix64(key XOR (part mod 2**64))
    generator = torch.Generator("cpu").manual_seed(key >> 1)
Positions are 0-based canvas indices (0 = first generated token); draws that belong
to the whole canvas rather than one row use position -1.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1

# Stream identifiers: one per kind of draw, so no two draws share a generator.
GUMBEL = 1  # LLaDA: float64 uniforms behind the Gumbel-max noise, one per vocab entry
REMASK = 2  # LLaDA `random` remasking: the row's confidence
FLIP = 3  # Dream `origin`: whether the row is unmasked at this step
SAMPLE = 4  # Dream: categorical sample of the row's token
SELECT = 5  # Dream with alg_temp: multinomial choice of rows to unmask (position -1)

WHOLE_CANVAS = -1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def stream_key(seed: int, step: int, position: int, stream: int) -> int:
    # Mixing the seed first keeps (seed s, step t) apart from (seed s^d, step t^d).
    key = _splitmix64(seed & _MASK64)
    for part in (step, position, stream):
        key = _splitmix64(key ^ (part & _MASK64))
    return key >> 1


def generator(seed: int, step: int, position: int, stream: int) -> torch.Generator:
    gen = torch.Generator(device="cpu")
    gen.manual_seed(stream_key(seed, step, position, stream))
    return gen
