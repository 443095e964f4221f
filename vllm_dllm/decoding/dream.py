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

from vllm_dllm.decoding import parallel_params, sampling
from vllm_dllm.decoding.base import BatchedRule, DecodeState, CandidatePlan
from vllm_dllm.decoding.vocab import WHOLE, Vocab
from vllm_dllm.options import DREAM, DREAM_ALGS, DreamOptions

ORIGIN = DREAM_ALGS.index("origin")
TOPK_MARGIN = DREAM_ALGS.index("topk_margin")
ENTROPY = DREAM_ALGS.index("entropy")


def unmask_fractions(steps: int, eps: float) -> torch.Tensor:
    """1 - s/t for every step, in the reference's float32 arithmetic."""
    t = torch.linspace(1, eps, steps + 1)
    return 1 - t[1:] / t[:-1]


def filter_top_p_top_k(logits: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor, vocab: Vocab = WHOLE,
                       k_max: int | None = None, any_top_p: bool = True) -> torch.Tensor:
    """The reference's top-p then top-k filters, per row (top_p >= 1 / top_k <= 0: off).

    Removed entries get the dtype's lowest value, as the reference's masked_fill does.
    The k-th value is taken after the top-p cut, as the reference does.  Known on
    the host: `k_max`, the largest top_k of the rows (0: no row filters by top-k),
    and `any_top_p`, whether some row filters by top-p.
    """
    lowest = torch.finfo(logits.dtype).min
    if any_top_p:
        removed = vocab.top_p_removed(logits, top_p) & (top_p < 1)[:, None]
        logits = logits.masked_fill(removed, lowest)
    size = vocab.size(logits)
    if k_max is None:
        k_max = int(top_k.clamp(max=size).max())
    if k_max <= 0:
        return logits
    kth = vocab.kth_largest(logits, top_k.clamp(min=1, max=min(k_max, size)), min(k_max, size))
    return logits.masked_fill((logits < kth) & (top_k > 0)[:, None], lowest)


class DreamRule(parallel_params.ParallelDecoding, BatchedRule):
    def __init__(self, state: DecodeState):
        super().__init__(state)
        cap, device = state.capacity, state.device
        self.alg = torch.zeros(cap, dtype=torch.long, device=device)
        self.alg_temp = torch.zeros(cap, dtype=torch.float32, device=device)  # 0: off
        self.top_p = torch.ones(cap, dtype=torch.float32, device=device)  # 1: off
        self.top_k = torch.zeros(cap, dtype=torch.long, device=device)  # 0: off
        self.fractions = torch.zeros(cap, 1, dtype=torch.float32, device=device)  # per step of a block
        self.filtered_host = np.zeros(cap, dtype=bool)
        self.top_k_host = np.zeros(cap, dtype=np.int64)
        self.top_p_host = np.ones(cap, dtype=np.float32)
        self.filtered = self.any_top_p = False
        self.top_k_max = 0
        # Host copies: a step whose requests use neither `origin` nor `alg_temp`
        # skips their per-position draws, without a device sync.
        self.origin_host = np.zeros(cap, dtype=bool)
        self.alg_host = np.zeros(cap, dtype=np.int64)
        self.margins = self.entropies = True
        self.alg_temp_host = np.zeros(cap, dtype=bool)
        self.flips = self.selects = True
        self.parallel = parallel_params.ParallelParams(cap, device, state.canvas.shape[1], state.vocab)

    def admit(self, slot: int, options: DreamOptions) -> None:
        self.alg[slot] = DREAM_ALGS.index(options.alg)
        self.alg_temp[slot] = options.alg_temp or 0.0
        self.top_p[slot] = 1.0 if options.top_p is None else options.top_p
        self.top_k[slot] = options.top_k or 0
        self.filtered_host[slot] = options.top_p is not None or options.top_k is not None
        self.top_k_host[slot] = options.top_k or 0
        self.top_p_host[slot] = 1.0 if options.top_p is None else options.top_p
        self.origin_host[slot] = options.alg == "origin"
        self.alg_host[slot] = DREAM_ALGS.index(options.alg)
        self.alg_temp_host[slot] = bool(options.alg_temp)
        self.parallel.admit(slot, options)
        steps = options.steps_per_block
        if steps > self.fractions.shape[1]:
            grown = torch.zeros(self.state.capacity, steps, device=self.fractions.device)
            grown[:, : self.fractions.shape[1]] = self.fractions
            self.fractions = grown
        self.fractions[slot, :steps] = unmask_fractions(steps, options.eps).to(self.fractions.device)
        self.admit_block_length(slot, options.gen_length // options.num_blocks)

    def prepare(self, slots_host) -> None:
        super().prepare(slots_host)
        slots_host = np.asarray(slots_host)
        self.filtered = bool(self.filtered_host[slots_host].any())
        self.top_k_max = int(self.top_k_host[slots_host].max(initial=0))
        self.any_top_p = bool((self.top_p_host[slots_host] < 1).any())
        self.flips = bool(self.origin_host[slots_host].any())
        algs = self.alg_host[slots_host]
        self.margins, self.entropies = bool((algs == TOPK_MARGIN).any()), bool((algs == ENTROPY).any())
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

    def plan(self, slots: torch.Tensor, width: int) -> CandidatePlan:
        state = self.state
        # Dream's schedule runs within the active block (the whole canvas by default).
        step = state.block_step[slots]
        length = self.block_length[slots]
        start = state.block[slots] * length
        columns = torch.arange(width, device=slots.device)
        in_block = (columns >= start[:, None]) & (columns < (start + length)[:, None])
        rows = self.canvas_rows(slots, width)
        masked = (rows == self.ids.mask) & in_block
        last = step >= state.steps_per_block[slots] - 1
        fraction = self.fractions[slots].gather(1, step.clamp(max=self.fractions.shape[1] - 1)[:, None]).squeeze(1)
        num_masked = masked.sum(dim=1)
        scheduled = torch.where(last, num_masked, (num_masked.float() / 1 * fraction).long())
        if not self.flips:
            return CandidatePlan(candidates=masked, count=scheduled, step_in_block=step, rows=rows)
        # origin: every masked position flips independently; only flipped ones commit.
        flips = self._position_draws(slots, width, sampling.FLIP, torch.float32) < fraction[:, None]
        origin = self.alg[slots] == ORIGIN
        candidates = masked & (~origin | last)[:, None] | masked & flips & origin[:, None]
        count = torch.where(origin, candidates.sum(dim=1), scheduled)
        return CandidatePlan(candidates=candidates, count=count, step_in_block=step, rows=rows)

    def pure_reduce(self) -> bool:
        return super().pure_reduce() and not self.filtered  # a filter sorts each row's vocabulary

    def reduce(self, logits, slots, positions):
        state = self.state
        vocab = state.vocab
        temperature = state.temperature[slots]
        logits = self.parallel.fuse_credit(slots, positions, logits)
        scaled = temperature > 0
        logits = logits / torch.where(scaled, temperature, 1.0)[:, None]
        if self.filtered:
            logits = filter_top_p_top_k(logits, self.top_p[slots], self.top_k[slots], vocab, self.top_k_max,
                                        self.any_top_p)
        probs = vocab.softmax(logits)
        confidence, tokens = vocab.max(probs)
        if self.sampled:
            u = sampling.uniform(state.seed[slots], state.step[slots], positions, sampling.SAMPLE, torch.float64)
            drawn = vocab.inverse_cdf(probs, u)
            tokens = torch.where(scaled, drawn, tokens)
            confidence = torch.where(scaled, vocab.at(probs, drawn), confidence)
        if self.margins:
            top2 = vocab.topk(probs, 2)[0]
            confidence = torch.where(self.alg[slots] == TOPK_MARGIN, top2[:, 0] - top2[:, 1], confidence)
        if self.entropies:
            entropy = vocab.sum(probs * torch.log(probs + 1e-10))
            confidence = torch.where(self.alg[slots] == ENTROPY, entropy, confidence)
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
