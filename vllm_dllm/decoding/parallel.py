"""Parallel decoding: how many of a block's candidates to commit at a step, decided
from the model's confidences instead of a fixed schedule.

Each function takes every request's ranking keys sorted descending ([R, width],
candidates first, non-candidates at -inf) and per-request parameters, and returns
the number of candidates each request commits.  Rules, from their published
definitions:

  threshold      Fast-dLLM (Wu et al. 2025, "Fast-dLLM: Training-free Acceleration of
                 Diffusion LLM by Enabling KV Cache and Parallel Decoding", sec. 3.3):
                 commit every masked position of the block whose confidence is at
                 least `threshold`, and always the most confident one.
  factor         Fast-dLLM's dynamic rule: with the confidences sorted c1 >= c2 >= ...,
                 commit the largest n such that c_i >= 1 - factor / (i + 1) for every
                 i <= n (at least one).
  entropy_bound  EB-sampler (Ben-Hamu et al. 2025, "Accelerated Sampling from Masked
                 Diffusion Models via Entropy Bounded Unmasking"): rank positions by
                 ascending entropy of their predictive distribution and commit while
                 the running sum of entropies stays <= `gamma` (at least one).  The
                 ranking key of a candidate is then its negated entropy.

How they meet the fixed schedule (decoding/llada.py): a step commits at least the
count the fixed schedule would (one per step when steps equal the canvas length, so
the rules above are exactly the published ones), so a block never takes more than
its fixed number of steps and the scheduler's step bound holds; and at most
`max_tokens_per_step` (0: no cap) unless that floor needs more.  A block ends as soon
as it has no masks left.
"""

from __future__ import annotations

import torch

from vllm_dllm.options import DECODING_RULES

FIXED, THRESHOLD, FACTOR, ENTROPY_BOUND = (DECODING_RULES.index(name) for name in DECODING_RULES)


def _leading(condition: torch.Tensor) -> torch.Tensor:
    """Per row, how many leading entries of a bool [R, width] are true."""
    return condition.long().cumprod(dim=1).sum(dim=1)


def by_threshold(ordered: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    return _leading(ordered >= threshold[:, None].double())


def by_factor(ordered: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    i = torch.arange(1, ordered.shape[1] + 1, device=ordered.device, dtype=torch.float64)
    return _leading(ordered >= 1 - factor[:, None].double() / (i + 1))


def by_entropy_bound(ordered: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """`ordered` holds negated entropies, so -ordered is ascending entropy."""
    return _leading((-ordered).cumsum(dim=1) <= gamma[:, None].double())


def commit_counts(
    ordered: torch.Tensor,
    rule: torch.Tensor,
    floor: torch.Tensor,
    candidates: torch.Tensor,
    *,
    threshold: torch.Tensor,
    factor: torch.Tensor,
    gamma: torch.Tensor,
    max_tokens_per_step: torch.Tensor,
) -> torch.Tensor:
    """Candidates each request commits: `floor` (the fixed schedule's count) for
    FIXED rows; for the others the rule's count (at least one, at most
    `max_tokens_per_step` when > 0), never below the floor nor above `candidates`."""
    decided = torch.where(
        rule == THRESHOLD,
        by_threshold(ordered, threshold),
        torch.where(rule == FACTOR, by_factor(ordered, factor), by_entropy_bound(ordered, gamma)),
    )
    decided = decided.clamp(min=1)
    decided = torch.where(max_tokens_per_step > 0, torch.minimum(decided, max_tokens_per_step), decided)
    count = torch.minimum(torch.maximum(decided, floor), candidates)
    return torch.where(rule == FIXED, floor, count)


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Entropy of each row of a probability matrix (0 log 0 = 0)."""
    return torch.special.entr(probs).sum(dim=-1)
