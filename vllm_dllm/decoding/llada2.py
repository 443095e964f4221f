"""LLaDA2.0's and LLaDA2.1's `generate()` over a batch: block diffusion with a
confidence threshold, and (2.1) token editing of the active block.

Geometry: the canvas is the generated region of a block-aligned window (the prompt's
partial last block is denoised together with the first generated positions, and the
last block is padded to whole blocks).  Canvas block k spans canvas positions
[k B - lead, (k + 1) B - lead), lead = prompt length mod B; the first is cut at 0.

LLaDA2.0, per step of a block: the quota k of the schedule (block_length // steps per
step, the first block_length % steps steps one more; trailing zeros when steps >
block_length); every masked position whose confidence exceeds `threshold` is committed
if there are at least k of them, else the k most confident; the block ends when it has
no masks, or after `steps` steps.

LLaDA2.1 (editing on): masks are committed the same way with `num_to_transfer` as the
fixed quota (M2T), and in the same step every generated, unmasked position of the
block whose predicted token differs from its current one with probability above
`editing_threshold` is rewritten (T2T).  A step that starts without masks counts as a
post step; the block ends after a step that started without masks and edited nothing,
or when the next step would be post step number `max_post_steps` + 1.

Parallel decoding (`decoding`, decoding/parallel.py: the same rule objects LLaDA and
Dream use): a parallel rule replaces the official choice of which masks of the active
block a step commits.  Without editing its floor is the 2.0 quota of the step (so a
block still ends within `steps` steps, as its reference's does, and sooner when it has
no masks left); with editing the rule picks the mask-to-token commits, its floor
`num_to_transfer`, while token-to-token editing, post steps and the block's end stay
exactly 2.1's.  That composition is the coherent one: 2.1's M2T choice is itself the
2.0 threshold-with-a-quota choice (the official rule is `fixed` here, and both reduce
to one count over the masks ranked by confidence), and editing reads only committed
positions, so the two decisions never touch the same position; refusing the pair
would refuse every 2.1 mode.  The rule sees only the block's masks: hierarchy's runs
are runs of masks, credit accrues on masked rows only and entropy_bound's entropies
rank masked rows only, so editing reads the model's plain prediction and probability
of every committed position as 2.1 does.  Entropies are of the distribution the
confidence is read from (the plain softmax at temperature 0, the tempered, filtered
one when sampling).

The mask id is never a prediction: the argmax and the draw leave it out (its
probability still counts in every confidence).  The references allow it, and
committing it leaves the position masked: under editing a model that keeps
predicting it would keep its block open forever (their loop has no bound then).  A
trained model never predicts the mask, so this only bounds a server's step count:
every step with masks commits at least one real token.

IterSmooth (engine/iter_smooth.py) feeds the block's still-masked positions their
expected embeddings; its falling threshold is the official rule's threshold here, as
it is a parallel rule's (parallel_params.ParallelParams.ramped).

Sampling as the references: temperature 0 takes the argmax, with the unfiltered
softmax probability as confidence; at T > 0 the logits are divided by T, filtered by
top-k then top-p, and a token is drawn from that distribution (inverse CDF from the
Philox stream, decoding/sampling.py); its probability there is its confidence.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_dllm.decoding import parallel, parallel_params, sampling
from vllm_dllm.decoding.base import BatchedRule, DecodeState, CandidatePlan, count_at, even_split
from vllm_dllm.decoding.vocab import WHOLE, Vocab
from vllm_dllm.options import LLADA2, LLaDA2Options

_LOWEST = float("-inf")


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, vocab: Vocab = WHOLE,
                       k_max: int | None = None, any_top_p: bool = True) -> torch.Tensor:
    """The references' top-k then top-p filters per row (top_k <= 0, top_p >= 1: off).
    Values tied with the k-th are kept; the token crossing top_p is kept.  Known on
    the host: `k_max`, the largest top_k of the rows (0: no row filters by top-k),
    and `any_top_p`, whether some row filters by top-p."""
    size = vocab.size(logits)
    if k_max is None:
        k_max = int(top_k.clamp(max=size).max())
    if k_max > 0:
        kth = vocab.kth_largest(logits, top_k.clamp(min=1, max=min(k_max, size)), min(k_max, size))
        logits = torch.where((top_k > 0)[:, None] & (logits < kth), _LOWEST, logits)
    if not any_top_p:
        return logits
    removed = vocab.top_p_removed(logits, top_p) & (top_p < 1)[:, None]
    return logits.masked_fill(removed, _LOWEST)


class LLaDA2Rule(BatchedRule):
    def __init__(self, state: DecodeState):
        super().__init__(state)
        cap, device = state.capacity, state.device

        def zeros(dtype):
            return torch.zeros(cap, dtype=dtype, device=device)

        self.lead = zeros(torch.long)
        self.threshold = zeros(torch.float32)
        self.editing = zeros(torch.bool)
        self.editing_host = np.zeros(cap, dtype=bool)
        self.editing_threshold = zeros(torch.float32)
        self.max_post_steps = zeros(torch.long)
        self.num_to_transfer = zeros(torch.long)
        self.post_steps = zeros(torch.long)
        self.edited = zeros(torch.long)  # positions the last step rewrote
        self.started_masked = zeros(torch.bool)  # the step being run began with masks in its block
        self.streamed = zeros(torch.long)  # canvas positions before it have streamed (structured outputs)
        self.top_k = zeros(torch.long)
        self.top_k_host = np.zeros(cap, dtype=np.int64)
        self.top_p_host = np.ones(cap, dtype=np.float32)
        self.top_k_max, self.any_top_p = 0, False
        self.top_p = torch.ones(cap, dtype=torch.float32, device=device)
        self.filtered = False
        self.parallel = parallel_params.ParallelParams(cap, device, state.canvas.shape[1], state.vocab,
                                                steps=lambda: state.step)

    def slot_holders(self) -> tuple:
        return (self, self.parallel)

    def admit(self, slot: int, options: LLaDA2Options) -> None:
        self.admit_block_length(slot, options.block_length)
        self.lead[slot] = options.lead
        self.threshold[slot] = options.threshold
        self.editing[slot] = options.editing_threshold is not None
        self.editing_host[slot] = options.editing_threshold is not None
        self.editing_threshold[slot] = options.editing_threshold or 0.0
        self.max_post_steps[slot] = options.max_post_steps
        self.num_to_transfer[slot] = options.num_to_transfer
        self.post_steps[slot] = 0
        self.edited[slot] = 0  # a batch without editing never writes it
        self.started_masked[slot] = False
        self.streamed[slot] = 0
        self.top_k[slot] = options.top_k or 0
        self.top_k_host[slot] = options.top_k or 0
        self.top_p_host[slot] = options.top_p or 1.0
        self.top_p[slot] = options.top_p or 1.0
        self.parallel.admit(slot, options)

    def prepare(self, slots_host) -> None:
        super().prepare(slots_host)
        # Filters apply only when sampling (at T == 0 the references take the argmax).
        self.filtered = self.sampled
        slots_host = np.asarray(slots_host)
        self.top_k_max = int(self.top_k_host[slots_host].max(initial=0))
        self.any_top_p = bool((self.top_p_host[slots_host] < 1).any())
        self.rewrites_committed = bool(self.editing_host[slots_host].any())
        self.parallel.prepare(slots_host)

    def block_range(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[start, end) of each request's active block, in canvas positions."""
        length = self.block_length[slots]
        start = self.state.block[slots] * length - self.lead[slots]
        return start.clamp(min=0), start + length

    def candidate_window(self, slots: torch.Tensor) -> torch.Tensor:
        return self.block_range(slots)[0]

    def pure_reduce(self) -> bool:
        return not self.parallel.credits  # credit is kept per position, updated as rows pass

    def _block_window(self, slots: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """bool [R, width]: each request's active block within its canvas; and the columns."""
        start, end = self.block_range(slots)
        columns = torch.arange(width, device=slots.device)
        in_block = (columns >= start[:, None]) & (columns < end[:, None]) & (columns < self.state.gen_length[slots, None])
        return in_block, columns

    def plan(self, slots: torch.Tensor, width: int) -> CandidatePlan:
        in_block, columns = self.per_call("window", lambda: self._block_window(slots, width))
        rows = self.canvas_rows(slots, width)
        masked = (rows == self.ids.mask) & in_block
        # The 2.0 quota: the block's length split evenly over its steps.
        parts = self.per_call("quota", lambda: even_split(self.block_length[slots], self.state.steps_per_block[slots]))
        step_in_block = self.state.block_step[slots]
        count, candidates = count_at(parts, step_in_block), masked
        if self.rewrites_committed:  # a request of the batch edits (2.1); known on the host
            editing = self.per_call("editing", lambda: self.editing[slots])
            # Editing reads every generated position of the block not yet streamed; 2.0
            # only its masks.
            editable = in_block & (columns >= self.streamed[slots, None])
            candidates = torch.where(editing[:, None], editable, masked)
            has_masks = masked.any(dim=1)
            self.started_masked[slots] = has_masks
            self.post_steps[slots] += (~has_masks & editing).long()
            count = torch.where(editing, self.per_call("per_step", lambda: self.num_to_transfer[slots]), count)
        count = torch.minimum(count, masked.sum(dim=1))
        return CandidatePlan(candidates=candidates, count=count, step_in_block=step_in_block, rows=rows,
                             window=in_block)

    def reduce(self, logits, slots, positions):
        state = self.state
        vocab = state.vocab
        mask = state.ids.mask
        # Rows still masked: the only ones a parallel rule's credit or entropy touches.
        masked = state.canvas[slots, positions] == mask if self.parallel.active else None
        logits = self.parallel.fuse_credit(slots, positions, logits, masked)
        # Confidences are the model's probabilities, the mask's share included; only
        # the choice of token leaves the mask out.
        greedy = logits.clone()
        vocab.fill_column(greedy, mask, None, _LOWEST)
        tokens = vocab.argmax(greedy)
        plain = vocab.softmax(logits.float())
        confidence = vocab.at(plain, tokens)
        if not self.sampled:
            return tokens, self.parallel.rank_by_entropy(slots, plain, confidence, masked)
        temperature = state.temperature[slots]
        hot = temperature > 0
        scaled = logits.double() / torch.where(hot, temperature, 1.0).double()[:, None]
        scaled = filter_top_k_top_p(scaled, self.top_k[slots], self.top_p[slots], vocab, self.top_k_max,
                                    self.any_top_p)
        probs = vocab.softmax(scaled)
        drawable = probs.clone()
        vocab.fill_column(drawable, mask, None, 0.0)
        u = sampling.uniform(state.seed[slots], state.step[slots], positions, sampling.LLADA_SAMPLE, torch.float64)
        drawn = vocab.inverse_cdf(drawable, u)
        tokens = torch.where(hot, drawn, tokens)
        drawn_conf = vocab.at(probs, drawn).float()
        confidence = torch.where(hot, drawn_conf, confidence)
        if not self.parallel.ranks_by_entropy:
            return tokens, confidence
        # The entropy of the distribution the confidence comes from (greedy rows: the
        # plain softmax, computed as in a batch that does not sample).
        confidence = self.parallel.rank_by_entropy(slots, plain, confidence, masked & ~hot)
        return tokens, self.parallel.rank_by_entropy(slots, probs, confidence, masked & hot)

    def commit(self, slots: torch.Tensor, plan: CandidatePlan, tokens: torch.Tensor, confidence: torch.Tensor) -> None:
        state = self.state
        width = plan.candidates.shape[1]
        current = state.canvas[slots, :width] if plan.rows is None else plan.rows
        masked = plan.candidates & (current == state.ids.mask) if self.rewrites_committed else plan.candidates
        # Masks, officially: all above the threshold when they reach the quota, else
        # the quota's most confident (ties toward the lower position).
        threshold = self.parallel.ramped(slots, self.per_call("threshold", lambda: self.threshold[slots]))
        high = (masked & (confidence > threshold[:, None])).sum(dim=1)
        official = torch.maximum(high, plan.count)
        if self.parallel.active:
            # A parallel rule ranks the masks (hierarchy: its selection first) and
            # counts them instead, never below the quota: the masks' plan counts what
            # `fixed` rows take and the quota for the others (parallel.commit_counts'
            # floor).
            fixed = self.per_call("fixed", lambda: self.parallel.rule[slots] == parallel.FIXED)
            official = torch.where(fixed, official, plan.count)
        masks = CandidatePlan(candidates=masked, count=official)
        keys = self.parallel.ranking_keys(slots, masks, confidence).double()
        keys = torch.where(masked, keys.clamp(min=-torch.finfo(torch.float64).max), _LOWEST)
        ordered, order = torch.sort(keys, dim=1, descending=True, stable=True)
        columns = self.per_call("columns", lambda: torch.arange(width, device=keys.device).expand_as(order))
        rank = torch.empty_like(order).scatter_(1, order, columns)
        take = self.parallel.counts(slots, masks, ordered)
        chosen = masked & (rank < take[:, None])
        edit = None
        if self.rewrites_committed:
            editing, editing_threshold = self.per_call("editing_rows", lambda: (
                self.editing[slots, None], self.editing_threshold[slots, None]))
            edit = (plan.candidates & ~masked & editing & (confidence > editing_threshold) & (tokens != current))
            chosen = chosen | edit
            self.edited[slots] = edit.sum(dim=1)
        rows = torch.where(chosen, tokens, current)
        state.canvas[slots, :width] = rows
        next_step = self.count_step(slots, plan)
        done = self._block_done(slots, plan, rows, next_step, edit)
        if self.rewrites_committed:
            self.post_steps[slots] = torch.where(done, 0, self.post_steps[slots])
        self.end_step(slots, rows, next_step, done)

    def _block_done(self, slots: torch.Tensor, plan: CandidatePlan, rows: torch.Tensor, next_step: torch.Tensor,
                    edit: torch.Tensor | None) -> torch.Tensor:
        """Whether each request's block ended with this commit (`rows`: its canvas
        rows after it; `next_step`: its steps in the block with this one; `edit`: the
        positions it edited, None where no request of the batch edits)."""
        state = self.state
        # The plan's window (it also stops at the canvas's end, where no mask is).
        window = self._block_window(slots, rows.shape[1])[0] if plan.window is None else plan.window
        masks_left = ((rows == state.ids.mask) & window).any(dim=1)
        # 2.0: no masks left, or the schedule's steps are spent.
        plain = ~masks_left | (next_step >= self.per_call("steps_per_block", lambda: state.steps_per_block[slots]))
        if edit is None:
            return plain
        # 2.1: a step begun without masks edited nothing; or the next step would be one
        # post step too many (checked before its forward by the reference).
        quiet = ~self.started_masked[slots] & ~edit.any(dim=1)
        exhausted = ~masks_left & (self.post_steps[slots] + 1 > self.max_post_steps[slots])
        return torch.where(self.editing[slots], quiet | exhausted, plain)

    def restart_block(self, slots: torch.Tensor, streamed: torch.Tensor) -> None:
        # A restarted block may begin with streamed tokens: editing leaves them be,
        # and they stay final.
        self.post_steps[slots] = 0
        self.streamed[slots] = streamed
        self.parallel.forget(slots, streamed)

    def edits(self, slots: torch.Tensor) -> torch.Tensor:
        return self.edited[slots]

    def num_final(self, slots: torch.Tensor, width: int) -> torch.Tensor:
        """Editing may rewrite any position of the active block until it ends: only
        earlier blocks are final.  Without editing, committed tokens never change."""
        final = self.state.num_final(slots, width)
        start, _ = self.block_range(slots)
        running = self.state.block[slots] < self.state.num_blocks[slots]
        settled = torch.maximum(torch.minimum(final, start), torch.minimum(self.streamed[slots], final))
        return torch.where(self.editing[slots] & running, settled, final)
