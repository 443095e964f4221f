"""Whether an engine call runs another denoising step (engine.py's later steps).

A call ends once a request's block has ended (a parallel decoding rule can end one
early; the next step is then laid out anew), or once every request has streamed what
finishes it: its last token, or a stop token among its final ones (vLLM ends it at
the end of the call).  Ending a call early is always safe, the next call goes on;
going on past that only wastes forwards.  The check costs one sync per later step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CallCheck:
    """What the check reads that stays fixed through a call, gathered once."""

    stop_ids: torch.Tensor  # [R, stop slots], -1 where unused
    output_length: torch.Tensor  # [R]
    columns: torch.Tensor  # arange(width)
    within: torch.Tensor  # bool [R, width]: the columns before each request's output length

    @classmethod
    def gather(cls, stop_ids: torch.Tensor, output_length: torch.Tensor, width: int) -> "CallCheck":
        columns = torch.arange(width, device=output_length.device)
        return cls(stop_ids, output_length, columns, columns < output_length[:, None])

    def stops(self, tokens: torch.Tensor) -> torch.Tensor:
        """bool [R, width]: where each request's canvas holds one of its stop tokens."""
        return (tokens[:, :, None] == self.stop_ids[:, None, :]).any(dim=2)

    def waiting_at_masks(self, tokens: torch.Tensor, mask_id: int) -> torch.Tensor:
        """bool [R, width], for rules that never rewrite a committed token (a final
        prefix ends at the first mask inside a block): the masks before a request's
        output end and before its every stop token.  A request waits while it has one."""
        return (tokens == mask_id) & (self.stops(tokens).cumsum(dim=1) == 0) & self.within

    def waiting(self, tokens: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
        """bool [R]: whether each request still waits, given its final prefix's length
        (any rule, token editing included)."""
        finished = (self.stops(tokens) & (self.columns < final[:, None])).any(dim=1) | (final >= self.output_length)
        return ~finished

    def goes_on(self, block_ended: torch.Tensor, waiting: torch.Tensor) -> torch.Tensor:
        """bool, 0-dim: the last step ended no request's block and one still waits
        (its host read is the one sync).  A call stops at the first step that ends a
        block, so the last step's ends are every end of the call."""
        return waiting.any() & ~block_ended.any()
