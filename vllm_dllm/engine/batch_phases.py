"""Refresh / Reuse, and block-causal segments, for a whole batch at once: the array
form of vllm_dllm/phases.py.

The scheduler prices one request at a time with `phases.step_phase`; the engine
needs the same answer for every scheduled request in a constant number of array
ops.  Both read the same per-request numbers, and a test holds them equal.  Host
bookkeeping is numpy (as vLLM's input batch keeps it): it never touches the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Cache policy codes (the order of options.CACHE_POLICIES).
POLICY_NONE, POLICY_PREFIX, POLICY_DUAL, POLICY_SPARSE, POLICY_VICINITY = 0, 1, 2, 3, 4


@dataclass
class PhaseParams:
    """Per-request numbers the phase depends on, int64 (has_cache: bool) numpy arrays."""

    prompt_len: np.ndarray
    gen_length: np.ndarray
    block: np.ndarray  # the active block
    block_step: np.ndarray  # steps run in it
    has_cache: np.ndarray
    policy: np.ndarray  # POLICY_*
    block_length: np.ndarray
    lead: np.ndarray  # positions a Reuse also runs before its block (phases.query_lead)
    vicinity: np.ndarray  # positions a Reuse also runs on each side of it (0 but for a vicinity cache)
    delay_step: np.ndarray
    refresh_interval: np.ndarray
    segment: np.ndarray  # block length of a block-causal request (phases.block_causal_phase), else 0
    prefilled: np.ndarray  # positions of a block-causal request whose K/V the pool holds (no cache yet)
    chunk: np.ndarray  # a block-causal request's prefill chunk in tokens (0: none)


@dataclass
class BatchPhases:
    refresh: np.ndarray  # bool [R]
    query_start: np.ndarray  # [R], sequence coordinates
    query_end: np.ndarray  # [R]
    reuse_start: np.ndarray  # [R]: the queries a Reuse step of the active block runs
    reuse_end: np.ndarray  # (a sparse Refresh ranks positions with them)
    segment: np.ndarray  # [R]: block-causal queries are segments of this many, 0: one sequence
    decodes: np.ndarray  # bool [R]: False for a prefill chunk (K/V only)

    @property
    def num_queries(self) -> np.ndarray:
        return self.query_end - self.query_start


def batch_phases(p: PhaseParams) -> BatchPhases:
    seq_len = p.prompt_len + p.gen_length
    k = p.block_step
    interval = p.refresh_interval
    periodic = (interval > 0) & ((k - p.delay_step) % np.maximum(interval, 1) == 0)
    refresh = (p.policy == POLICY_NONE) | ~p.has_cache | (k <= p.delay_step) | periodic
    block_start = p.prompt_len + p.block * p.block_length
    reuse_end = np.where(p.policy == POLICY_PREFIX, seq_len,
                         np.minimum(block_start + p.block_length + p.vicinity, seq_len))
    reuse_start = np.maximum(block_start - p.lead - p.vicinity, 0)
    query_start = np.where(refresh, 0, reuse_start)
    query_end = np.where(refresh, seq_len, reuse_end)

    causal = p.segment > 0
    length = np.maximum(p.segment, 1)
    active = p.prompt_len - p.prompt_len % length + p.block * length
    end = active + length
    boundary = (p.block_step == 0) & (p.block > 0)
    run = np.where(p.chunk > 0, np.maximum(p.chunk // length, 1) * length, 0)
    chunked = ~p.has_cache & (run > 0) & (end - p.prefilled > run)
    causal_start = np.where(~p.has_cache, p.prefilled, np.where(boundary, active - length, active))
    refresh = np.where(causal, ~p.has_cache, refresh)
    query_start = np.where(causal, causal_start, query_start)
    query_end = np.where(causal, np.where(chunked, p.prefilled + run, end), query_end)
    return BatchPhases(refresh=refresh, query_start=query_start, query_end=query_end,
                       reuse_start=reuse_start, reuse_end=reuse_end, segment=p.segment,
                       decodes=~(causal & chunked))
