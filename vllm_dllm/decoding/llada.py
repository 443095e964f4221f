"""LLaDA's `generate()` over a batch: semi-autoregressive blocks, low-confidence or
random remasking, temperature sampling, classifier-free guidance (in decoding/logits.py).

Follows MODEL_SPEC.md section 3 step by step; departures: a token at T > 0 is drawn
from softmax(logits / T) by inverse CDF from the Philox stream (the distribution of
the reference's Gumbel-max, decoding/sampling.py), and ties rank toward the lower
position (base.BatchedRule.commit).
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_dllm.decoding import parallel_params, sampling
from vllm_dllm.decoding.base import BatchedRule, DecodeState, CandidatePlan, count_at, even_split
from vllm_dllm.options import LLADA, LLaDAOptions


def transfer_count(num_masked: torch.Tensor, steps: torch.Tensor, step_in_block: torch.Tensor) -> torch.Tensor:
    """Tokens to commit at a step of a block: m // steps, the first m % steps steps get +1."""
    return count_at(even_split(num_masked, steps), step_in_block)


class LLaDARule(parallel_params.ParallelDecoding, BatchedRule):
    def __init__(self, state: DecodeState):
        super().__init__(state)
        cap, device = state.capacity, state.device

        def zeros(dtype):
            return torch.zeros(cap, dtype=dtype, device=device)

        self.block_masked = zeros(torch.long)  # masked positions of the block at its start
        self.random_remasking = zeros(torch.bool)
        # Host copy: a step without `random` remasking skips its draws, no device sync.
        self.random_remasking_host = np.zeros(cap, dtype=bool)
        self.remasks_randomly = True
        self.logits_eos_inf = zeros(torch.bool)
        self.confidence_eos_eot_inf = zeros(torch.bool)
        # Host copies: a step where no request sets them skips their column writes.
        self.eos_flags_host = np.zeros((cap, 2), dtype=bool)
        self.any_logits_eos_inf = self.any_confidence_eos_eot_inf = True
        self.parallel = parallel_params.ParallelParams(cap, device, state.canvas.shape[1], state.vocab,
                                                steps=lambda: state.step)

    def admit(self, slot: int, options: LLaDAOptions) -> None:
        self.admit_block_length(slot, options.block_length)
        self.block_masked[slot] = 0
        self.random_remasking[slot] = options.remasking == "random"
        self.random_remasking_host[slot] = options.remasking == "random"
        self.logits_eos_inf[slot] = options.logits_eos_inf
        self.confidence_eos_eot_inf[slot] = options.confidence_eos_eot_inf
        self.eos_flags_host[slot] = (options.logits_eos_inf, options.confidence_eos_eot_inf)
        self.parallel.admit(slot, options)

    def prepare(self, slots_host) -> None:
        super().prepare(slots_host)
        self.parallel.prepare(slots_host)
        slots_host = np.asarray(slots_host)
        self.remasks_randomly = bool(self.random_remasking_host[slots_host].any())
        self.any_logits_eos_inf, self.any_confidence_eos_eot_inf = self.eos_flags_host[slots_host].any(axis=0).tolist()

    def plan(self, slots: torch.Tensor, width: int) -> CandidatePlan:
        spb = self.per_call("steps_per_block", lambda: self.state.steps_per_block[slots])
        in_block = self.per_call("in_block", lambda: self._block_window(slots, width))
        step_in_block = self.state.block_step[slots]
        rows = self.canvas_rows(slots, width)
        candidates = (rows == self.ids.mask) & in_block
        masked_now = candidates.sum(dim=1)

        def at_block_start():  # a later step of a call is never a block's first
            block_masked = torch.where(step_in_block == 0, masked_now, self.block_masked[slots])
            self.block_masked[slots] = block_masked
            return block_masked

        block_masked = self.per_call("block_masked", at_block_start)
        parts = self.per_call("transfer_parts", lambda: even_split(block_masked, spb))
        count = torch.minimum(count_at(parts, step_in_block), masked_now)
        return CandidatePlan(candidates=candidates, count=count, step_in_block=step_in_block, rows=rows)

    def _block_window(self, slots: torch.Tensor, width: int) -> torch.Tensor:
        """bool [R, width]: the columns of each request's active block."""
        length = self.block_length[slots]
        start = self.state.block[slots] * length
        columns = torch.arange(width, device=slots.device)
        return (columns >= start[:, None]) & (columns < (start + length)[:, None])

    def reduce(self, logits, slots, positions):
        ids, state = self.ids, self.state
        vocab = state.vocab
        sampled_or_remasked = self.sampled or self.remasks_randomly
        seeds, steps = (state.seed[slots], state.step[slots]) if sampled_or_remasked else (None, None)
        # `logits_eos_inf` and the confidence's edits below are column writes: the
        # rank holding the column makes them (decoding/vocab.py).
        if self.any_logits_eos_inf:
            vocab.fill_column(logits, ids.eos, self.logits_eos_inf[slots], float("-inf"))
        logits = self.parallel.fuse_credit(slots, positions, logits)
        if self.sampled:
            temperature = state.temperature[slots]
            u = sampling.uniform(seeds, steps, positions, sampling.LLADA_SAMPLE, torch.float64)
            tokens = sampling.sample(logits, temperature, u, vocab)
        else:
            tokens = vocab.argmax(logits)
        # The reference's chained assignment: at T == 0 the noisy logits are the
        # logits themselves, so both EOS and EoT lose their mass; at T > 0 only EoT
        # does (its EOS write lands on the discarded noisy copy).
        if self.any_confidence_eos_eot_inf:
            conf_inf = self.confidence_eos_eot_inf[slots]
            greedy = conf_inf & (state.temperature[slots] == 0) if self.sampled else conf_inf
            vocab.fill_column(logits, ids.eos, greedy, float("-inf"))
            if ids.eot is not None:
                vocab.fill_column(logits, ids.eot, conf_inf, float("-inf"))
        probs = vocab.softmax(logits)
        confidence = vocab.at(probs, tokens)
        if self.remasks_randomly:
            drawn = sampling.uniform(seeds, steps, positions, sampling.REMASK, torch.float32)
            confidence = torch.where(self.random_remasking[slots], drawn, confidence)
        return tokens, self.parallel.rank_by_entropy(slots, probs, confidence)

    def ranking_keys(self, slots, plan, confidence):
        return self.parallel.ranking_keys(slots, plan, confidence)
