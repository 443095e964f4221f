"""The interface every decoding rule implements, and the registry that finds one.

A rule owns one request's canvas (the generated positions, masked until committed)
and decides, step by step, which rows need logits, what each row's candidate token
and confidence are, and which candidates are committed.  Rules are pure tensor code:
they never see the model, the batch or the KV cache.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from vllm_dllm.options import DecodeOptions


@dataclass(frozen=True)
class SpecialIds:
    mask: int
    eos: int
    eot: int | None = None


class DecodingRule(ABC):
    def __init__(self, options: DecodeOptions, ids: SpecialIds, seed: int, prompt_len: int = 0):
        self.options = options
        self.ids = ids
        self.seed = seed
        self.prompt_len = prompt_len
        self.step = 0
        self.canvas = torch.full((options.gen_length,), ids.mask, dtype=torch.long)

    @property
    def masked(self) -> torch.Tensor:
        return self.canvas == self.ids.mask

    @property
    def done(self) -> bool:
        return not bool(self.masked.any())

    def num_final(self) -> int:
        """Length of the committed prefix: tokens that can be streamed out.

        After the configured steps everything is final, as the references return the
        canvas then, even if a position was committed as the mask token itself.
        """
        if self.step >= self.options.steps:
            return self.options.gen_length
        masked = self.masked.nonzero()
        return int(masked[0]) if len(masked) else self.options.gen_length

    def commit_most_confident(
        self, positions: torch.Tensor, tokens: torch.Tensor, confidence: torch.Tensor, count: int
    ) -> None:
        """Commit the `count` most confident candidates.

        The references rank over the whole sequence (prompt + canvas) with -inf off
        the candidates; ranking the same vector keeps their tie-breaking.
        """
        if count <= 0:
            return
        full = torch.full(
            (self.prompt_len + self.options.gen_length,), float("-inf"), dtype=confidence.dtype
        )
        full[self.prompt_len + positions] = confidence
        chosen = torch.topk(full, count).indices - self.prompt_len
        proposal = self.canvas.clone()
        proposal[positions] = tokens
        self.canvas[chosen] = proposal[chosen]

    @abstractmethod
    def rows_needing_logits(self) -> torch.Tensor:
        """Canvas positions (ascending) whose logits this step needs."""

    @abstractmethod
    def reduce(
        self, logits: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Reduce a chunk of logits rows to (candidate token, confidence) per row.

        `logits` may be modified in place; the caller frees it afterwards.
        """

    @abstractmethod
    def commit(
        self, positions: torch.Tensor, tokens: torch.Tensor, confidence: torch.Tensor
    ) -> None:
        """Write the chosen candidates into the canvas and advance one step."""


_RULES: dict[str, type[DecodingRule]] = {}


def register_rule(kind: str):
    def wrap(cls: type[DecodingRule]) -> type[DecodingRule]:
        _RULES[kind] = cls
        return cls

    return wrap


def make_rule(
    kind: str, options: DecodeOptions, ids: SpecialIds, seed: int, prompt_len: int = 0
) -> DecodingRule:
    # Importing the rule modules fills the registry.
    from vllm_dllm.decoding import dream, llada  # noqa: F401

    try:
        cls = _RULES[kind]
    except KeyError:
        raise ValueError(f"no decoding rule for model kind '{kind}'") from None
    return cls(options, ids, seed, prompt_len)
