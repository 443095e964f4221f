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
from dataclasses import dataclass

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
