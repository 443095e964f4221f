"""IterSmooth (dInfer): a still-masked position enters the next step as the mask's
embedding plus w * (softmax(logits) @ W_e), the expected embedding under the
distribution the model gave it this step (options/smoothing.py has the weights).

The rows are the ones the LM head projects anyway (the candidates of each request's
active block), so the step never projects a position only to smooth it: a position
is smoothed from its block's second step on.  Per slot, the expected embeddings of
its last candidates are kept at entry position % width, tagged with the position
(-1: none), `width` at least every smoothing request's block, so the positions of
one block never share an entry.  Nothing here loops over requests; the store is
allocated when the first smoothing request arrives and widened, entries kept, for a
wider block.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from vllm_dllm.decoding.vocab import Vocab
from vllm_dllm.options.smoothing import smooth_weight_at


class SoftEmbeddings:
    """Per-slot expected embeddings of still-masked positions, written from the LM
    head's logits chunks and added to the next forward's input embeddings.

    `embedding_rows()` returns the input embedding's rows for the logits' columns
    (this rank's vocabulary shard under TP; more rows are cut to the columns)."""

    def __init__(self, capacity: int, device: torch.device, vocab: Vocab,
                 embedding_rows: Callable[[], torch.Tensor]):
        self.device = device
        self.vocab = vocab
        self.embedding_rows = embedding_rows
        self.cap = torch.zeros(capacity, dtype=torch.float32, device=device)  # 0: not smoothing
        self.cap_host = np.zeros(capacity, dtype=np.float32)
        self.tags: torch.Tensor | None = None  # [capacity, width] canvas position, -1: none
        self.values: torch.Tensor | None = None  # [capacity, width, hidden]

    @property
    def width(self) -> int:
        return 0 if self.tags is None else self.tags.shape[1]

    def make_room(self, options) -> None:
        """Room for a request's blocks, before it takes a slot (raises for a model
        without an input embedding)."""
        if getattr(options, "iter_smooth", False):
            self._widen(options.block_length)

    def admit(self, slot: int, options) -> None:
        """The request's weights (make_room first)."""
        on = bool(getattr(options, "iter_smooth", False))
        cap = float(options.smooth_weight) if on else 0.0
        self.cap[slot] = cap
        self.cap_host[slot] = cap
        if on:
            self.tags[slot] = -1

    def asks(self, slots_host: np.ndarray) -> bool:
        """Whether a request of these slots smooths (host arrays: no sync)."""
        return bool((self.cap_host[np.asarray(slots_host)] > 0).any())

    def record(self, logits: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
               steps: torch.Tensor) -> None:
        """Keep each candidate row's expected embedding, weighted for its request's
        step `steps` (the steps it ran before this one).  Rows of requests that do not
        smooth weigh 0 and are tagged as none."""
        weight = smooth_weight_at(steps.float(), self.cap[slots])
        rows = self.embedding_rows()
        rows = rows[: logits.shape[-1]]
        probs = self.vocab.softmax(logits.float()).to(rows.dtype)
        expected = self.vocab.sum_over_ranks(probs @ rows)
        entry = positions % self.width
        self.values[slots, entry] = (expected * weight[:, None].to(expected.dtype)).to(self.values.dtype)
        self.tags[slots, entry] = torch.where(weight > 0, positions, -1)

    def add_to(self, embeds: torch.Tensor, input_ids: torch.Tensor, token_source, mask_id: int,
               rebuild: torch.Tensor | None = None) -> torch.Tensor:
        """`embeds` of a step's rows with the kept expected embedding added where the
        row is a canvas position, still masked, with a kept entry (`token_source`:
        StepInputs'; `rebuild`: bool per row reading a past canvas, never smoothed)."""
        in_prompt, _, row_slot, canvas_index = token_source
        entry = canvas_index % self.width
        use = ~in_prompt & (input_ids == mask_id) & (self.tags[row_slot, entry] == canvas_index)
        if rebuild is not None:
            use &= ~rebuild
        added = self.values[row_slot, entry].to(embeds.dtype)
        return embeds + torch.where(use[:, None], added, 0)

    def forget(self, slots: torch.Tensor, streamed: torch.Tensor) -> None:
        """Positions from `streamed` on went back to the mask (structured outputs):
        what the model said of them before no longer stands."""
        if self.tags is None:
            return
        tags = self.tags[slots]
        self.tags[slots] = torch.where(tags >= streamed[:, None], -1, tags)

    def grow_slots(self, capacity: int) -> None:
        old = len(self.cap)
        self.cap = torch.cat([self.cap, self.cap.new_zeros(capacity - old)])
        self.cap_host = np.concatenate([self.cap_host, np.zeros(capacity - old, dtype=np.float32)])
        if self.tags is not None:
            self.tags = torch.cat([self.tags, self.tags.new_full((capacity - old, self.width), -1)])
            self.values = torch.cat([self.values, self.values.new_zeros((capacity - old, *self.values.shape[1:]))])

    def _widen(self, block: int) -> None:
        """At least `block` entries per slot; kept entries move to their new place
        (positions of one block stay apart at any width >= the block)."""
        if block <= self.width:
            return
        width = 1 << max(block - 1, 1).bit_length()
        rows = self.embedding_rows()
        tags = torch.full((len(self.cap), width), -1, dtype=torch.long, device=self.device)
        values = torch.zeros((len(self.cap), width, rows.shape[1]), dtype=rows.dtype, device=self.device)
        if self.tags is not None:
            slot, old = (self.tags >= 0).nonzero(as_tuple=True)
            moved = self.tags[slot, old]
            tags[slot, moved % width] = moved
            values[slot, moved % width] = self.values[slot, old]
        self.tags, self.values = tags, values
