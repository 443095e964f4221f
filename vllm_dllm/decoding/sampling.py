"""Random draws of the decoding rules, from the counter-based Philox stream.

Every draw is keyed by (request seed, denoising step, canvas position, stream): the
bits depend on nothing else, so seeded sampling is reproducible whatever else
shares the batch, however rows are chunked, on every device.  The contract is in
vllm_dllm/decoding/philox.py; on CUDA the Triton implementation gives the same bits.

A token at temperature T is an exact draw from softmax(logits / T) by inverse CDF,
one float64 uniform per row: the distribution LLaDA's `add_gumbel_noise` (Gumbel-max
with float64 noise) and Dream's multinomial sample from, without vocabulary-wide
noise.  Contract: token = the smallest id whose float64 cumulative probability
exceeds u * (total probability).
"""

from __future__ import annotations

import torch

from vllm_dllm.decoding.vocab import WHOLE, Vocab
from vllm_dllm.decoding import philox

# Stream identifiers: one per kind of draw, so no two draws share bits.
LLADA_SAMPLE = 1  # LLaDA at T > 0: the row's token (float64)
REMASK = 2  # LLaDA `random` remasking: the row's confidence (float32)
FLIP = 3  # Dream `origin`: whether the row is unmasked at this step (float32)
SAMPLE = 4  # Dream at T > 0: the row's token (float64)
SELECT = 5  # Dream with alg_temp: Gumbel key of the position in the choice of rows (float64)


def uniform(seeds, steps, positions, stream: int, dtype: torch.dtype) -> torch.Tensor:
    """One draw per row, in (0, 1)."""
    if seeds.device.type == "cuda":
        from vllm_dllm.decoding.triton_philox import HAS_TRITON, uniform_rows_triton

        if HAS_TRITON:
            return uniform_rows_triton(seeds, steps, positions, stream, 1, dtype)[:, 0]
    return philox.uniform(seeds, steps, positions, stream, dtype)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor, vocab: Vocab = WHOLE) -> torch.Tensor:
    """Per row, the smallest id whose cumulative probability exceeds u * total."""
    return vocab.inverse_cdf(probs, u)


def sample(logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor, vocab: Vocab = WHOLE) -> torch.Tensor:
    """A token from softmax(logits / T) per row (float64); rows at T == 0 take the argmax."""
    hot = temperature > 0
    scaled = logits.double() / torch.where(hot, temperature, 1.0).double()[:, None]
    drawn = vocab.inverse_cdf(vocab.softmax(scaled), u)
    return torch.where(hot, drawn, vocab.argmax(logits))
