"""Dream's `diffusion_generate` over a batch: origin or confidence algs, temperature,
top-p/top-k, alg_temp.  By default the whole canvas is one block, the reference;
with `block_length` the canvas is decoded block by block (the structure of Fast-dLLM's
Dream cache loop, which the prefix/dual KV caches need), Dream's own rule and schedule
running within each block.

Follows MODEL_SPEC.md section 3 (Dream `_sample`), including its float32 schedule
arithmetic and `int()` truncation.  Departures: random numbers come from the Philox
stream (decoding/sampling.py); a token is drawn by inverse CDF, and alg_temp's
choice of positions by Gumbel-top-k (the same distribution as multinomial without
replacement); ties rank toward the lower position.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_dllm.decoding import parallel, sampling
from vllm_dllm.decoding.base import BatchedRule, DecodeState, StepPlan, register_rule
from vllm_dllm.options import DREAM, DREAM_ALGS, DreamOptions

ORIGIN = DREAM_ALGS.index("origin")
TOPK_MARGIN = DREAM_ALGS.index("topk_margin")
ENTROPY = DREAM_ALGS.index("entropy")


def unmask_fractions(steps: int, eps: float) -> torch.Tensor:
    """1 - s/t for every step, in the reference's float32 arithmetic."""
    t = torch.linspace(1, eps, steps + 1)
    return 1 - t[1:] / t[:-1]


def filter_top_p_top_k(logits: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """The reference's top-p then top-k filters, per row (top_p >= 1 / top_k <= 0: off).

    Removed entries get the dtype's lowest value, as the reference's masked_fill does.
    """
    lowest = torch.finfo(logits.dtype).min
    ordered, order = torch.sort(logits, dim=-1, descending=True)
    cumulative = torch.cumsum(torch.softmax(ordered, dim=-1), dim=-1)
    remove = cumulative > top_p[:, None]
    # Keep the token that crosses the threshold: shift right by one, keep the first.
    remove = torch.cat([torch.zeros_like(remove[:, :1]), remove[:, :-1]], dim=1)
    remove &= (top_p < 1)[:, None]
    ordered = ordered.masked_fill(remove, lowest)
    kth_index = (top_k.clamp(min=1, max=logits.shape[-1]) - 1)[:, None]
    kth = ordered.gather(1, kth_index)
    remove_k = (ordered < kth) & (top_k > 0)[:, None]
    ordered = ordered.masked_fill(remove_k, lowest)
    return torch.empty_like(logits).scatter_(1, order, ordered)


@register_rule(DREAM)
class DreamRule(parallel.ParallelDecoding, BatchedRule):
    def __init__(self, state: DecodeState):
        super().__init__(state)
        cap, device = state.capacity, state.device
        self.alg = torch.zeros(cap, dtype=torch.long, device=device)
        self.alg_temp = torch.zeros(cap, dtype=torch.float32, device=device)  # 0: off
        self.top_p = torch.ones(cap, dtype=torch.float32, device=device)  # 1: off
        self.top_k = torch.zeros(cap, dtype=torch.long, device=device)  # 0: off
        self.fractions = torch.zeros(cap, 1, dtype=torch.float32, device=device)  # per step of a block
        self.block_length = torch.ones(cap, dtype=torch.long, device=device)
        self.filtered_host = np.zeros(cap, dtype=bool)
        self.filtered = False
        # Host copies: a step whose requests use neither `origin` nor `alg_temp`
        # skips their per-position draws, without a device sync.
        self.origin_host = np.zeros(cap, dtype=bool)
        self.alg_temp_host = np.zeros(cap, dtype=bool)
        self.flips = self.selects = True
        self.parallel = parallel.ParallelParams(cap, device, state.canvas.shape[1])

    def admit(self, slot: int, options: DreamOptions) -> None:
        self.alg[slot] = DREAM_ALGS.index(options.alg)
        self.alg_temp[slot] = options.alg_temp or 0.0
        self.top_p[slot] = 1.0 if options.top_p is None else options.top_p
        self.top_k[slot] = options.top_k or 0
        self.filtered_host[slot] = options.top_p is not None or options.top_k is not None
        self.origin_host[slot] = options.alg == "origin"
        self.alg_temp_host[slot] = bool(options.alg_temp)
        self.parallel.admit(slot, options)
        steps = options.steps_per_block
        if steps > self.fractions.shape[1]:
            grown = torch.zeros(self.state.capacity, steps, device=self.fractions.device)
            grown[:, : self.fractions.shape[1]] = self.fractions
            self.fractions = grown
        self.fractions[slot, :steps] = unmask_fractions(steps, options.eps).to(self.fractions.device)
        self.block_length[slot] = options.gen_length // options.num_blocks

    def prepare(self, slots_host) -> None:
        super().prepare(slots_host)
        slots_host = np.asarray(slots_host)
        self.filtered = bool(self.filtered_host[slots_host].any())
        self.flips = bool(self.origin_host[slots_host].any())
        self.selects = bool(self.alg_temp_host[slots_host].any())
        self.parallel.prepare(slots_host)

    def _position_draws(self, slots: torch.Tensor, width: int, stream: int, dtype: torch.dtype) -> torch.Tensor:
        """One draw per (request, canvas position): [R, width]."""
        state = self.state
        rows = len(slots)
        positions = torch.arange(width, device=slots.device).repeat(rows)
        seeds = state.seed[slots].repeat_interleave(width)
        steps = state.step[slots].repeat_interleave(width)
        return sampling.uniform(seeds, steps, positions, stream, dtype).view(rows, width)

    def plan(self, slots: torch.Tensor, width: int) -> StepPlan:
        state = self.state
        # Dream's schedule runs within the active block (the whole canvas by default).
        step = state.block_step[slots]
        length = self.block_length[slots]
        start = state.block[slots] * length
        columns = torch.arange(width, device=slots.device)
        in_block = (columns >= start[:, None]) & (columns < (start + length)[:, None])
        masked = state.masked(slots, width) & in_block
        last = step >= state.steps_per_block[slots] - 1
        fraction = self.fractions[slots].gather(1, step.clamp(max=self.fractions.shape[1] - 1)[:, None]).squeeze(1)
        num_masked = masked.sum(dim=1)
        scheduled = torch.where(last, num_masked, (num_masked.float() / 1 * fraction).long())
        if not self.flips:
            return StepPlan(candidates=masked, count=scheduled)
        # origin: every masked position flips independently; only flipped ones commit.
        flips = self._position_draws(slots, width, sampling.FLIP, torch.float32) < fraction[:, None]
        origin = self.alg[slots] == ORIGIN
        candidates = masked & (~origin | last)[:, None] | masked & flips & origin[:, None]
        count = torch.where(origin, candidates.sum(dim=1), scheduled)
        return StepPlan(candidates=candidates, count=count)

    def reduce(self, logits, slots, positions):
        state = self.state
        temperature = state.temperature[slots]
        logits = self.parallel.fuse_credit(slots, positions, logits)
        scaled = temperature > 0
        logits = logits / torch.where(scaled, temperature, 1.0)[:, None]
        if self.filtered:
            logits = filter_top_p_top_k(logits, self.top_p[slots], self.top_k[slots])
        probs = torch.softmax(logits, dim=-1)
        confidence, tokens = probs.max(dim=-1)
        if self.sampled:
            u = sampling.uniform(state.seed[slots], state.step[slots], positions, sampling.SAMPLE, torch.float64)
            drawn = sampling.inverse_cdf(probs, u)
            tokens = torch.where(scaled, drawn, tokens)
            confidence = torch.where(scaled, probs.gather(1, drawn[:, None]).squeeze(1), confidence)
        alg = self.alg[slots]
        top2 = torch.topk(probs, 2, dim=-1).values
        confidence = torch.where(alg == TOPK_MARGIN, top2[:, 0] - top2[:, 1], confidence)
        entropy = torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
        confidence = torch.where(alg == ENTROPY, entropy, confidence)
        return tokens, self.parallel.rank_by_entropy(slots, probs, confidence)

    def ranking_keys(self, slots, plan, confidence):
        # alg_temp: positions drawn without replacement with weights
        # softmax(confidence / alg_temp): Gumbel-top-k over confidence / alg_temp.
        if not self.selects:
            return self.parallel.ranking_keys(slots, plan, confidence.double())
        alg_temp = self.alg_temp[slots]
        u = self._position_draws(slots, plan.candidates.shape[1], sampling.SELECT, torch.float64)
        gumbel = -torch.log(-torch.log(u))
        perturbed = (confidence.float() / torch.where(alg_temp > 0, alg_temp, 1.0)[:, None]).double() + gumbel
        keys = torch.where((alg_temp > 0)[:, None], perturbed, confidence.double())
        return self.parallel.ranking_keys(slots, plan, keys)
