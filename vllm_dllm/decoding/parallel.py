"""Parallel decoding: how many of a block's candidates to commit at a step, decided
from the model's confidences instead of a fixed schedule.

Each rule is a small class (ParallelRule) registered under its `decoding` name: from
every request's ranking keys sorted descending ([R, width], candidates first,
non-candidates at -inf) and per-request parameters it returns the number of
candidates each request commits; a rule may also rerank the candidates or add credit
to the logits.  A batch may mix rules: each present rule computes its count for the
batch and its requests take it (a constant number of ops per rule present).  Rules,
from their published definitions:

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
  hierarchy      dInfer's HierarchyDecoder (Ma et al. 2025, "dInfer: An Efficient
                 Inference Framework for Diffusion Language Models";
                 inclusionAI/dInfer python/dinfer/decoding/parallel_strategy.py at
                 fce4e328): the candidates split into maximal runs of consecutive
                 masked positions; each run commits its most confident position if
                 that confidence is > `low_threshold`, every position > `threshold`
                 commits, and the most confident position always does.  Runs shrink
                 and split as positions commit, which is the recursion.  A set, not a
                 count: its members are ranked first (`hierarchy_keys`) and counted.
  credit         dInfer's CreditThresholdParallelDecoder (same source; CreditDecoding,
                 arXiv 2510.06133): every masked position of the block keeps a credit
                 per token, which decays by `credit_decay` each step while the token
                 with the highest probability gains p ** `credit_boost`; the logits
                 become logits + `credit_alpha` * log(1 + credit), and the threshold
                 rule runs on those.  dInfer keeps a dense [positions, vocabulary]
                 matrix; we keep the CREDIT_SLOTS tokens with the most credit per
                 position (a newcomer replaces the least), the same whenever a
                 position's top token changes fewer than CREDIT_SLOTS + 1 times.

How they meet the fixed schedule (decoding/llada.py, dream.py, llada2.py): a step
commits at least the count the fixed schedule would (one per step when steps equal
the canvas length, so the rules above are exactly the published ones), so a block
never takes more than its fixed number of steps and the scheduler's step bound
holds; and at most `max_tokens_per_step` (0: no cap) unless that floor needs more.
A block ends as soon as it has no masks left.  On LLaDA2.x the rules choose among
the active block's masks in place of the official quota/threshold choice, with the
official quota as the floor (decoding/llada2.py; under 2.1's editing they pick the
mask-to-token commits only).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from vllm_dllm.decoding.vocab import WHOLE, Vocab
from vllm_dllm.options import DECODING_RULES

FIXED, THRESHOLD, FACTOR, ENTROPY_BOUND, HIERARCHY, CREDIT = (DECODING_RULES.index(name) for name in DECODING_RULES)
CREDIT_SLOTS = 4

# Added to the ranking key of a position a set-based rule selects: above every
# confidence (a probability or a margin, <= 1), so the selected rank first.
SELECTED = 4.0


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


def by_selection(ordered: torch.Tensor) -> torch.Tensor:
    return (ordered >= SELECTED).sum(dim=1)


def hierarchy_selection(candidates: torch.Tensor, confidence: torch.Tensor, threshold: torch.Tensor,
                        low_threshold: torch.Tensor) -> torch.Tensor:
    """bool [R, width]: each run's most confident position above `low_threshold`,
    and every position above `threshold` (strictly, as dInfer compares)."""
    rows, width = candidates.shape
    conf = torch.where(candidates, confidence.double(), float("-inf"))
    previous = torch.nn.functional.pad(candidates[:, :-1], (1, 0), value=False)
    starts = candidates & ~previous
    run = torch.cumsum(starts.long(), dim=1) + torch.arange(rows, device=conf.device)[:, None] * (width + 1)
    run_max = torch.full((rows * (width + 1),), float("-inf"), dtype=conf.dtype, device=conf.device)
    run_max = run_max.scatter_reduce(0, run.flatten(), conf.flatten(), reduce="amax").view(-1)[run]
    best_of_run = candidates & (conf == run_max)
    return (best_of_run & (conf > low_threshold[:, None].double())) | (candidates & (conf > threshold[:, None].double()))


@dataclass
class RowParameters:
    """The rules' parameters for the requests of a step, one entry per request."""

    threshold: torch.Tensor
    factor: torch.Tensor
    gamma: torch.Tensor
    low_threshold: torch.Tensor


class ParallelRule(ABC):
    """One parallel decoding rule, found by its name (the `decoding` option): how many
    of a request's ranked candidates it commits, and optionally how it ranks them."""

    name = ""
    ranks_by_entropy = False  # its ranking key is a candidate's negated entropy
    carries_credit = False  # its logits carry per-token credit (ParallelParams.fuse_credit)
    reranks = False  # it changes the ranking keys (`keys`)

    def keys(self, candidates: torch.Tensor, keys: torch.Tensor, rows: RowParameters) -> torch.Tensor:
        return keys

    @abstractmethod
    def count(self, ordered: torch.Tensor, rows: RowParameters) -> torch.Tensor:
        """Candidates each request commits, from its ranking keys sorted descending."""


_RULES: dict[str, ParallelRule] = {}


def register(cls: type[ParallelRule]) -> type[ParallelRule]:
    _RULES[cls.name] = cls()
    return cls


def rule_named(name: str) -> ParallelRule:
    return _RULES[name]


@register
class Threshold(ParallelRule):
    name = "threshold"

    def count(self, ordered, rows):
        return by_threshold(ordered, rows.threshold)


@register
class Factor(ParallelRule):
    name = "factor"

    def count(self, ordered, rows):
        return by_factor(ordered, rows.factor)


@register
class EntropyBound(ParallelRule):
    name = "entropy_bound"
    ranks_by_entropy = True

    def count(self, ordered, rows):
        return by_entropy_bound(ordered, rows.gamma)


@register
class Hierarchy(ParallelRule):
    name = "hierarchy"
    reranks = True

    def keys(self, candidates, keys, rows):
        selected = hierarchy_selection(candidates, keys, rows.threshold, rows.low_threshold)
        return torch.where(selected, keys.double() + SELECTED, keys.double())

    def count(self, ordered, rows):
        return by_selection(ordered)


@register
class Credit(Threshold):
    name = "credit"
    carries_credit = True


def commit_counts(
    ordered: torch.Tensor,
    codes: torch.Tensor,
    floor: torch.Tensor,
    candidates: torch.Tensor,
    rows: RowParameters,
    max_tokens_per_step: torch.Tensor,
    present: list[str] | None = None,
) -> torch.Tensor:
    """Candidates each request commits: `floor` (the fixed schedule's count) for
    FIXED rows; for the others their rule's count (at least one, at most
    `max_tokens_per_step` when > 0), never below the floor nor above `candidates`.
    `present`: the rules some request uses (default: all)."""
    decided = torch.ones_like(floor)
    for name in present if present is not None else _RULES:
        decided = torch.where(codes == DECODING_RULES.index(name), _RULES[name].count(ordered, rows), decided)
    decided = decided.clamp(min=1)
    decided = torch.where(max_tokens_per_step > 0, torch.minimum(decided, max_tokens_per_step), decided)
    count = torch.minimum(torch.maximum(decided, floor), candidates)
    return torch.where(codes == FIXED, floor, count)


def entropy(probs: torch.Tensor, vocab: Vocab = WHOLE) -> torch.Tensor:
    """Entropy of each row of a probability matrix (0 log 0 = 0)."""
    return vocab.sum(torch.special.entr(probs))


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
        codes = [DECODING_RULES.index(name) for name in self.present if getattr(_RULES[name], flag)]
        return torch.isin(self.rule[slots], torch.tensor(codes, device=slots.device))

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

    def restart_block(self, slots, streamed):
        super().restart_block(slots, streamed)
        self.parallel.forget(slots, streamed)

    def block_done(self, slots, plan):
        if not self.parallel.active:  # only the fixed schedule in this step
            return super().block_done(slots, plan)
        masked = self.state.masked(slots, plan.candidates.shape[1])
        return super().block_done(slots, plan) | self.parallel.block_emptied(slots, plan, masked)
