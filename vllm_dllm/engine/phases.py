"""Refresh / Reuse for a whole batch at once: the tensor form of vllm_dllm/phases.py.

The scheduler prices one request at a time with `phases.step_phase`; the engine
needs the same answer for every scheduled request in a constant number of tensor
ops.  Both read the same per-request numbers, and a test holds them equal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Cache policy codes (the order of options.CACHE_POLICIES).
POLICY_NONE, POLICY_PREFIX, POLICY_DUAL = 0, 1, 2


@dataclass
class PhaseParams:
    """Per-request numbers the phase depends on, host tensors over the batch."""

    prompt_len: torch.Tensor
    gen_length: torch.Tensor
    step: torch.Tensor
    has_cache: torch.Tensor  # bool
    policy: torch.Tensor  # POLICY_*
    block_length: torch.Tensor
    steps_per_block: torch.Tensor
    delay_step: torch.Tensor
    refresh_interval: torch.Tensor


@dataclass
class BatchPhases:
    refresh: torch.Tensor  # bool [R]
    query_start: torch.Tensor  # [R], sequence coordinates
    query_end: torch.Tensor  # [R]

    @property
    def num_queries(self) -> torch.Tensor:
        return self.query_end - self.query_start


def batch_phases(p: PhaseParams) -> BatchPhases:
    seq_len = p.prompt_len + p.gen_length
    k = p.step % p.steps_per_block
    interval = p.refresh_interval
    periodic = (interval > 0) & ((k - p.delay_step) % interval.clamp(min=1) == 0)
    refresh = (p.policy == POLICY_NONE) | ~p.has_cache | (k <= p.delay_step) | periodic
    block_start = p.prompt_len + (p.step // p.steps_per_block) * p.block_length
    reuse_end = torch.where(p.policy == POLICY_PREFIX, seq_len, block_start + p.block_length)
    query_start = torch.where(refresh, torch.zeros_like(block_start), block_start)
    query_end = torch.where(refresh, seq_len, reuse_end)
    return BatchPhases(refresh=refresh, query_start=query_start, query_end=query_end)
