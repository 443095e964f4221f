"""Per-request parallel-decoding state (decoding/parallel.py has the rules): each
slot's rule and parameters as tensors, the credit store, and the two decisions they
drive for a batch, how many candidates a request commits and whether its block
ended; and the mixin through which a BatchedRule follows them."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from vllm_dllm.decoding.parallel import (
    _RULES,
    CREDIT_SLOTS,
    FIXED,
    RowParameters,
    commit_counts,
    entropy,
)
from vllm_dllm.decoding.vocab import WHOLE, Vocab
from vllm_dllm.options import DECODING_RULES


class ParallelParams:
    """Per-slot parallel-decoding parameters of a rule, and the two decisions they
    drive: how many candidates a request commits, and whether its block ended."""

    def __init__(self, capacity: int, device: torch.device, max_gen: int, vocab: Vocab = WHOLE,
                 steps: Callable[[], torch.Tensor] | None = None):
        """`steps()`: the steps each slot's request has run (DecodeState.step), which
        an IterSmooth request's threshold falls with."""

        def zeros(dtype):
            return torch.zeros(capacity, dtype=dtype, device=device)

        self.max_gen = max_gen
        self.vocab = vocab
        # Credit per (slot, canvas position): the tokens holding it (-1: none) and
        # its amount; allocated when the first credit request arrives.
        self.credit_tokens: torch.Tensor | None = None
        self.credit_values: torch.Tensor | None = None
        self.credit_alpha = zeros(torch.float32)
        self.credit_decay = zeros(torch.float32)
        self.credit_boost = zeros(torch.float32)
        self.credits = False  # some request of this step uses credit

        self.rule = zeros(torch.long)
        self.threshold = zeros(torch.float32)
        self.factor = zeros(torch.float32)
        self.gamma = zeros(torch.float32)
        self.low_threshold = zeros(torch.float32)
        self.max_tokens_per_step = zeros(torch.long)
        # IterSmooth: the threshold starts at 1 and falls by this much a step (0: off).
        self.threshold_decay = zeros(torch.float32)
        self.threshold_decay_host = np.zeros(capacity, dtype=np.float32)
        self.steps = steps
        self.ramps = False  # some request of this step has a falling threshold
        self.rule_host = np.zeros(capacity, dtype=np.int64)
        self.active = False  # some request of this step decodes in parallel
        self.ranks_by_entropy = False  # some request of this step uses entropy_bound
        self.selects = False  # some request of this step uses a rule that reranks
        self.present: list[str] = []  # the parallel rules of this step's requests

    def admit(self, slot: int, options) -> None:
        code = DECODING_RULES.index(options.decoding)
        self.rule[slot] = code
        self.rule_host[slot] = code
        self.threshold[slot] = options.threshold
        self.factor[slot] = options.factor
        self.gamma[slot] = options.gamma
        self.low_threshold[slot] = options.low_threshold
        self.max_tokens_per_step[slot] = options.max_tokens_per_step
        smooths = getattr(options, "iter_smooth", False) and self.steps is not None
        decay = options.smooth_threshold_decay if smooths else 0.0
        self.threshold_decay[slot] = decay
        self.threshold_decay_host[slot] = decay
        self.credit_alpha[slot] = options.credit_alpha
        self.credit_decay[slot] = options.credit_decay
        self.credit_boost[slot] = options.credit_boost
        if _RULES.get(options.decoding) is not None and _RULES[options.decoding].carries_credit:
            if self.credit_tokens is None:
                shape = (len(self.rule), self.max_gen, CREDIT_SLOTS)
                self.credit_tokens = torch.full(shape, -1, dtype=torch.long, device=self.rule.device)
                self.credit_values = torch.zeros(shape, dtype=torch.float32, device=self.rule.device)
            self.credit_tokens[slot] = -1
            self.credit_values[slot] = 0.0

    def forget(self, slots: torch.Tensor, streamed: torch.Tensor) -> None:
        """Credit of positions from `streamed` on starts over: their tokens went back
        to the mask (structured outputs), and the credit that chose them would
        choose them again."""
        if self.credit_tokens is None:
            return
        columns = torch.arange(self.max_gen, device=slots.device)
        drop = (columns[None, :] >= streamed[:, None])[:, :, None]
        self.credit_tokens[slots] = torch.where(drop, -1, self.credit_tokens[slots])
        self.credit_values[slots] = torch.where(drop, 0.0, self.credit_values[slots])

    def prepare(self, slots_host) -> None:
        codes = np.unique(self.rule_host[np.asarray(slots_host)])
        self.present = [DECODING_RULES[code] for code in codes if code != FIXED]
        rules = [_RULES[name] for name in self.present]
        self.active = bool(rules)
        self.ranks_by_entropy = any(rule.ranks_by_entropy for rule in rules)
        self.credits = any(rule.carries_credit for rule in rules)
        self.selects = any(rule.reranks for rule in rules)
        self.ramps = bool((self.threshold_decay_host[np.asarray(slots_host)] > 0).any())

    def _rows_of(self, slots: torch.Tensor, flag: str) -> torch.Tensor:
        """bool per request: its rule has `flag` set."""
        rules = self.rule[slots]
        rows = torch.zeros_like(rules, dtype=torch.bool)
        # One comparison per rule present (a handful), with no tensor from the host:
        # a captured step (engine/step_graphs.py) cannot copy one in.
        for name in self.present:
            if getattr(_RULES[name], flag):
                rows |= rules == DECODING_RULES.index(name)
        return rows

    def ramped(self, slots: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
        """`threshold` per request, an IterSmooth request's held at 1 - decay x the
        steps it ran while that is higher (dInfer's falling threshold)."""
        if not self.ramps:
            return threshold
        decay = self.threshold_decay[slots]
        falling = torch.where(decay > 0, 1 - decay * self.steps()[slots].float(), 0.0)
        return torch.maximum(threshold, falling)

    def row_parameters(self, slots: torch.Tensor) -> RowParameters:
        return RowParameters(self.ramped(slots, self.threshold[slots]), self.factor[slots], self.gamma[slots],
                             self.low_threshold[slots])

    def fuse_credit(self, slots: torch.Tensor, positions: torch.Tensor, logits: torch.Tensor,
                    masked: torch.Tensor | None = None) -> torch.Tensor:
        """Credit requests' logits with their positions' credit added, after this
        step's decay and gain (rows are (slot, canvas position) candidates, each
        once per step).  `masked` (bool per row, default all): the rows whose
        position is still masked, the only ones credit reads or changes (LLaDA2.1's
        candidates include committed positions, which it may edit)."""
        if not self.credits:
            return logits
        uses = self._rows_of(slots, "carries_credit")
        if masked is not None:
            uses = uses & masked
        tokens = self.credit_tokens[slots, positions]  # [N, K]
        values = self.credit_values[slots, positions] * self.credit_decay[slots, None]
        top_p, top = self.vocab.max(self.vocab.softmax(logits.float()))
        gain = top_p.pow(self.credit_boost[slots])
        match = tokens == top[:, None]
        held = match.any(dim=1)
        k = torch.where(held, match.int().argmax(dim=1), values.argmin(dim=1))  # else replace the least
        kept = torch.where(held, values.gather(1, k[:, None]).squeeze(1), 0.0)
        tokens = tokens.scatter(1, k[:, None], top[:, None])
        values = values.scatter(1, k[:, None], (kept + gain)[:, None])
        self.credit_tokens[slots, positions] = torch.where(uses[:, None], tokens, self.credit_tokens[slots, positions])
        self.credit_values[slots, positions] = torch.where(uses[:, None], values, self.credit_values[slots, positions])
        boost = self.credit_alpha[slots, None] * torch.log1p(values) * uses[:, None]
        return self.vocab.scatter_add(logits, tokens, boost)

    def rank_by_entropy(self, slots: torch.Tensor, probs: torch.Tensor, confidence: torch.Tensor,
                        masked: torch.Tensor | None = None) -> torch.Tensor:
        """entropy_bound requests rank their candidates by negated entropy (only the
        rows in `masked` when given: the others keep their confidence)."""
        if not self.ranks_by_entropy:
            return confidence
        rows = self._rows_of(slots, "ranks_by_entropy")
        if masked is not None:
            rows = rows & masked
        return torch.where(rows, -entropy(probs, self.vocab).to(confidence.dtype), confidence)

    def ranking_keys(self, slots: torch.Tensor, plan, keys: torch.Tensor) -> torch.Tensor:
        """Keys of the requests whose rule reranks (hierarchy: its selection first)."""
        if not self.selects:
            return keys
        rows = self.row_parameters(slots)
        for name in self.present:
            rule = _RULES[name]
            if rule.reranks:
                mine = self.rule[slots] == DECODING_RULES.index(name)
                keys = torch.where(mine[:, None], rule.keys(plan.candidates, keys, rows), keys.double())
        return keys

    def counts(self, slots: torch.Tensor, plan, ordered_keys: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return plan.count
        return commit_counts(
            ordered_keys, self.rule[slots], plan.count, plan.candidates.sum(dim=1), self.row_parameters(slots),
            self.max_tokens_per_step[slots], self.present,
        )

    def block_emptied(self, slots: torch.Tensor, plan, masked: torch.Tensor) -> torch.Tensor:
        """Parallel requests whose active block (their candidates' region) has no
        masks left after the commit: their block ends now."""
        if not self.active:
            return torch.zeros(len(slots), dtype=torch.bool, device=slots.device)
        return (self.rule[slots] != FIXED) & ~(plan.candidates & masked).any(dim=1)


class ParallelDecoding:
    """Mixed into a BatchedRule whose `parallel` is a ParallelParams: the commit count
    and the block's end follow the requests' parallel rules."""

    parallel: ParallelParams

    def slot_holders(self) -> tuple:
        return (self, self.parallel)

    def commit_count(self, slots, plan, ordered_keys):
        return self.parallel.counts(slots, plan, ordered_keys)

    def pure_reduce(self) -> bool:
        return not self.parallel.credits  # credit is kept per position, updated as rows pass

    def restart_block(self, slots, streamed):
        super().restart_block(slots, streamed)
        self.parallel.forget(slots, streamed)

    def block_done(self, slots, plan, next_step):
        if not self.parallel.active:  # only the fixed schedule in this step
            return super().block_done(slots, plan, next_step)
        masked = self.state.masked(slots, plan.candidates.shape[1])
        return super().block_done(slots, plan, next_step) | self.parallel.block_emptied(slots, plan, masked)
