"""LLaDA's `generate()`: semi-autoregressive blocks, low-confidence or random remasking.

Follows MODEL_SPEC.md section 3 step by step; the only departure is where random
numbers come from (see rng.py), so that seeded sampling is batch-invariant.
"""

from __future__ import annotations

import torch

from vllm_dllm.decoding import rng
from vllm_dllm.decoding.base import DecodingRule, SpecialIds, register_rule
from vllm_dllm.options import LLADA, LLaDAOptions


def transfer_counts(num_masked: int, steps: int) -> list[int]:
    """Tokens to commit at each step of a block: m // steps, the first m % steps get +1."""
    base, extra = divmod(num_masked, steps)
    return [base + (1 if i < extra else 0) for i in range(steps)]


@register_rule(LLADA)
class LLaDARule(DecodingRule):
    options: LLaDAOptions

    def __init__(self, options: LLaDAOptions, ids: SpecialIds, seed: int, prompt_len: int = 0):
        super().__init__(options, ids, seed, prompt_len)
        self._counts: list[int] = []

    @property
    def block(self) -> int:
        return self.step // self.options.steps_per_block

    @property
    def step_in_block(self) -> int:
        return self.step % self.options.steps_per_block

    def block_bounds(self) -> tuple[int, int]:
        start = self.block * self.options.block_length
        return start, start + self.options.block_length

    def rows_needing_logits(self) -> torch.Tensor:
        start, end = self.block_bounds()
        if self.step_in_block == 0:
            num_masked = int(self.masked[start:end].sum())
            self._counts = transfer_counts(num_masked, self.options.steps_per_block)
        return self.masked[start:end].nonzero().flatten() + start

    def reduce(
        self, logits: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        opts, ids = self.options, self.ids
        if opts.logits_eos_inf:
            logits[:, ids.eos] = float("-inf")
        if opts.temperature > 0:
            noisy = torch.empty(logits.shape, dtype=torch.float64, device=logits.device)
            for row, pos in enumerate(positions.tolist()):
                gen = rng.generator(self.seed, self.step, pos, rng.GUMBEL)
                u = torch.rand(logits.shape[1], dtype=torch.float64, generator=gen)
                noisy[row] = (-torch.log(u)).pow(opts.temperature).to(logits.device)
            noisy = torch.exp(logits.double()) / noisy
            tokens = noisy.argmax(dim=-1)
            del noisy
        else:
            tokens = logits.argmax(dim=-1)
        if opts.confidence_eos_eot_inf:
            # The reference's chained assignment: at T == 0 the noisy logits are the
            # logits themselves, so both EOS and EoT lose their mass; at T > 0 only
            # EoT does (its EOS write lands on the discarded noisy copy).
            if opts.temperature == 0:
                logits[:, ids.eos] = float("-inf")
            if ids.eot is not None:
                logits[:, ids.eot] = float("-inf")
        if opts.remasking == "low_confidence":
            probs = torch.softmax(logits, dim=-1)
            confidence = probs.gather(1, tokens[:, None]).squeeze(1)
        else:
            confidence = torch.stack(
                [
                    torch.rand(
                        1,
                        dtype=torch.float32,
                        generator=rng.generator(self.seed, self.step, pos, rng.REMASK),
                    )[0]
                    for pos in positions.tolist()
                ]
            ).to(logits.device)
        return tokens, confidence

    def commit(
        self, positions: torch.Tensor, tokens: torch.Tensor, confidence: torch.Tensor
    ) -> None:
        count = self._counts[self.step_in_block] if self._counts else 0
        count = min(count, len(positions))
        self.commit_most_confident(positions.cpu(), tokens.cpu(), confidence.cpu(), count)
        self.step += 1
