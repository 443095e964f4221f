"""Log-probabilities of committed tokens, as vLLM reports them.

A token's logprob is taken from the distribution of the step that committed it: the
model's logits for that position at that step (after classifier-free guidance, before
anything a rule does to them), log-softmaxed; vLLM's default `raw_logprobs`.  Each
row carries the committed token first, then the row's `k` most likely tokens, and the
token's rank (1 + the tokens strictly more likely), the layout of vLLM's
LogprobsLists.  Computed per chunk of the LM-head pass, never over the whole step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_dllm.decoding.vocab import WHOLE, Vocab


@dataclass
class CandidateLogprobs:
    """One step's candidates (in the order the rule reduced them)."""

    ids: torch.Tensor  # long [n, k + 1]: the candidate's token, then the top k
    values: torch.Tensor  # float32 [n, k + 1]: their logprobs
    rank: torch.Tensor  # long [n]: the candidate token's rank

    @classmethod
    def cat(cls, parts: list["CandidateLogprobs"]) -> "CandidateLogprobs":
        if len(parts) == 1:
            return parts[0]
        return cls(torch.cat([p.ids for p in parts]), torch.cat([p.values for p in parts]),
                   torch.cat([p.rank for p in parts]))


def candidate_logprobs(raw_logits: torch.Tensor, tokens: torch.Tensor, k: int,
                       vocab: Vocab = WHOLE) -> CandidateLogprobs:
    """Logprob rows for `tokens`, one per row of `raw_logits` ([n, vocab] or the
    rows' columns of `vocab`)."""
    logprobs = vocab.log_softmax(raw_logits.float())
    token_logprob = vocab.at(logprobs, tokens)[:, None]
    top_values, top_ids = vocab.topk(logprobs, k)
    # vLLM's rank counts the tokens at least as likely as the sampled one.
    rank = vocab.sum((logprobs >= token_logprob).long())
    return CandidateLogprobs(
        ids=torch.cat([tokens[:, None], top_ids], dim=1),
        values=torch.cat([token_logprob, top_values], dim=1),
        rank=rank,
    )


class LogprobsCollector:
    """Gathers the logprob rows of a step's candidates chunk by chunk."""

    def __init__(self, k: int, device: torch.device, vocab: Vocab = WHOLE):
        self.k = k
        self.device = device
        self.vocab = vocab
        self.parts: list[CandidateLogprobs] = []

    def add(self, raw_logits: torch.Tensor, tokens: torch.Tensor) -> None:
        self.parts.append(candidate_logprobs(raw_logits, tokens, self.k, self.vocab))

    def result(self) -> CandidateLogprobs:
        if not self.parts:
            width = self.k + 1
            return CandidateLogprobs(torch.empty(0, width, dtype=torch.long, device=self.device),
                                     torch.empty(0, width, dtype=torch.float32, device=self.device),
                                     torch.empty(0, dtype=torch.long, device=self.device))
        return CandidateLogprobs.cat(self.parts)
