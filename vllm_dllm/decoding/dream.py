"""Dream's `diffusion_generate`: the whole canvas is active; origin or confidence algs.

Follows MODEL_SPEC.md section 3 (Dream `_sample`), including its float32 schedule
arithmetic and `int()` truncation; random numbers come from rng.py.
"""

from __future__ import annotations

import torch

from vllm_dllm.decoding import rng
from vllm_dllm.decoding.base import DecodingRule, SpecialIds, register_rule
from vllm_dllm.options import DREAM, DreamOptions


def filter_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_logits, sorted_idx = torch.sort(logits, descending=True)
    cumulative = torch.cumsum(torch.softmax(sorted_logits, dim=-1), dim=-1)
    remove_sorted = cumulative > top_p
    remove_sorted[..., 1:] = remove_sorted[..., :-1].clone()
    remove_sorted[..., 0] = False
    remove = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, sorted_idx, remove_sorted)
    return logits.masked_fill(remove, torch.finfo(logits.dtype).min)


def filter_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    top_k = min(top_k, logits.shape[-1])
    kth = torch.topk(logits, top_k)[0][..., -1, None]
    return logits.masked_fill(logits < kth, torch.finfo(logits.dtype).min)


@register_rule(DREAM)
class DreamRule(DecodingRule):
    options: DreamOptions

    def __init__(self, options: DreamOptions, ids: SpecialIds, seed: int, prompt_len: int = 0):
        super().__init__(options, ids, seed, prompt_len)
        self._timesteps = torch.linspace(1, options.eps, options.steps + 1)

    @property
    def _last_step(self) -> bool:
        return self.step >= self.options.steps - 1

    def _unmask_fraction(self) -> torch.Tensor:
        """1 - s/t for this step, in the reference's float32 arithmetic."""
        t = self._timesteps[self.step]
        s = self._timesteps[self.step + 1]
        return 1 - s / t

    def rows_needing_logits(self) -> torch.Tensor:
        masked = self.masked.nonzero().flatten()
        if self.options.alg != "origin" or self._last_step:
            return masked
        # origin: every masked row flips independently; only flipped rows need a token.
        p_transfer = self._unmask_fraction()
        flips = [
            bool(
                torch.rand(
                    1,
                    dtype=torch.float32,
                    generator=rng.generator(self.seed, self.step, pos, rng.FLIP),
                )[0]
                < p_transfer
            )
            for pos in masked.tolist()
        ]
        return masked[torch.tensor(flips, dtype=torch.bool)] if flips else masked

    def reduce(
        self, logits: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        opts = self.options
        if opts.temperature > 0:
            logits = logits / opts.temperature
        if opts.top_p is not None:
            logits = filter_top_p(logits, opts.top_p)
        if opts.top_k is not None:
            logits = filter_top_k(logits, opts.top_k)
        probs = torch.softmax(logits, dim=-1)
        if opts.temperature > 0:
            tokens = torch.stack(
                [
                    torch.multinomial(
                        probs[row].cpu(),
                        1,
                        replacement=True,
                        generator=rng.generator(self.seed, self.step, pos, rng.SAMPLE),
                    )[0]
                    for row, pos in enumerate(positions.tolist())
                ]
            ).to(probs.device)
            confidence = probs.gather(1, tokens[:, None]).squeeze(1)
        else:
            confidence, tokens = probs.max(dim=-1)
        if opts.alg == "topk_margin":
            top2 = torch.topk(probs, 2, dim=-1).values
            confidence = top2[:, 0] - top2[:, 1]
        elif opts.alg == "entropy":
            confidence = torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
        return tokens, confidence

    def commit(
        self, positions: torch.Tensor, tokens: torch.Tensor, confidence: torch.Tensor
    ) -> None:
        positions, tokens = positions.cpu(), tokens.cpu()
        if self.options.alg == "origin":
            self.canvas[positions] = tokens
        else:
            self._commit_confident(positions, tokens, confidence.cpu())
        self.step += 1

    def _commit_confident(
        self, positions: torch.Tensor, tokens: torch.Tensor, confidence: torch.Tensor
    ) -> None:
        num_masked = len(positions)
        if self._last_step:
            count = num_masked
        else:
            count = int(torch.tensor(num_masked) / 1 * self._unmask_fraction())
        alg_temp = self.options.alg_temp
        if alg_temp is None:
            self.commit_most_confident(positions, tokens, confidence, count)
            return
        if count <= 0:
            return
        # The reference draws over the whole sequence with -inf off the masks; the
        # contract draws over the canvas, which gives the same distribution.
        full = torch.full((self.options.gen_length,), float("-inf"))
        full[positions] = confidence.float()
        weights = torch.softmax(full / alg_temp, dim=-1)
        picked = torch.multinomial(
            weights,
            count,
            replacement=False,
            generator=rng.generator(self.seed, self.step, rng.WHOLE_CANVAS, rng.SELECT),
        )
        proposal = self.canvas.clone()
        proposal[positions] = tokens
        self.canvas[picked] = proposal[picked]
