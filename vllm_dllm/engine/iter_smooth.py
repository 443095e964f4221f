"""IterSmooth (dInfer): a still-masked position enters the next step as the mask's
embedding plus w * (softmax(logits) @ W_e), the expected embedding under the
distribution the model gave it this step (options/smoothing.py has the weights).

The rows are the ones the LM head projects anyway (the candidates of each request's
active block), so the step never projects a position only to smooth it: a position
is smoothed from its block's second step on, by what the step before said of it.
Each smoothing request holds a lane of the store while it is in the batch: its last
step's candidates' expected embeddings at entry position % width, tagged with the
position (-1: none), `width` at least every smoothing request's block so that the
positions of one block never share an entry.  Requests without a lane read and
write the store's last lane, which is never tagged.  Nothing here loops over
requests; the store is allocated when the first smoothing request arrives and grows
(entries kept) for a wider block or more smoothing requests at once.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from vllm_dllm.decoding.vocab import Vocab
from vllm_dllm.options.smoothing import smooth_weight_at


class SoftEmbeddings:
    """Expected embeddings of still-masked positions per smoothing request, written
    from the LM head's logits chunks and added to the next forward's inputs.

    `embedding_rows()` returns the input embedding's rows for the logits' columns
    (this rank's vocabulary shard under TP; more rows are cut to the columns); None:
    the model has none, and smoothing requests are refused."""

    def __init__(self, capacity: int, device: torch.device, vocab: Vocab,
                 embedding_rows: Callable[[], torch.Tensor] | None):
        self.device = device
        self.vocab = vocab
        self.embedding_rows = embedding_rows
        self.cap = torch.zeros(capacity, dtype=torch.float32, device=device)  # 0: not smoothing
        self.cap_host = np.zeros(capacity, dtype=np.float32)
        self.lane_of = torch.full((capacity,), -1, dtype=torch.long, device=device)  # -1: no lane
        self.lane_host = np.full(capacity, -1, dtype=np.int64)
        self._free_lanes: list[int] = []
        self.tags: torch.Tensor | None = None  # [lanes + 1, width] canvas position, -1: none
        self.values: torch.Tensor | None = None  # [lanes + 1, width, hidden]

    @property
    def width(self) -> int:
        return 0 if self.tags is None else self.tags.shape[1]

    @property
    def lanes(self) -> int:
        return 0 if self.tags is None else self.tags.shape[0] - 1

    def make_room(self, options) -> None:
        """A free lane as wide as the request's blocks, before it takes a slot
        (raises for a model without an input embedding)."""
        if getattr(options, "iter_smooth", False):
            if self.embedding_rows is None:
                raise ValueError("iter_smooth needs the model's input embedding, and this model exposes none")
            lanes = self.lanes if self._free_lanes else max(1, 2 * self.lanes)
            self._grow(lanes, max(self.width, 1 << max(options.block_length - 1, 1).bit_length()))

    def admit(self, slot: int, options) -> None:
        """The request's weights, and a lane of its own if it smooths (make_room first)."""
        self.release(slot)
        if not getattr(options, "iter_smooth", False):
            return
        cap = float(options.smooth_weight)
        self.cap[slot], self.cap_host[slot] = cap, cap
        lane = self._free_lanes.pop()
        self.lane_of[slot], self.lane_host[slot] = lane, lane
        self.tags[lane] = -1

    def release(self, slot: int) -> None:
        """The slot's request left: its lane goes back."""
        lane = int(self.lane_host[slot])
        if lane >= 0:
            self._free_lanes.append(lane)
        self.cap[slot], self.cap_host[slot] = 0.0, 0.0
        self.lane_of[slot], self.lane_host[slot] = -1, -1

    def asks(self, slots_host: np.ndarray) -> bool:
        """Whether a request of these slots smooths (host arrays: no sync)."""
        return bool((self.cap_host[np.asarray(slots_host)] > 0).any())

    def _lanes(self, slots: torch.Tensor) -> torch.Tensor:
        lane = self.lane_of[slots]
        return torch.where(lane >= 0, lane, self.lanes)

    def clear(self, slots: torch.Tensor) -> None:
        """Before a step's candidates are recorded: what the step before said is
        spent (its forward has read it)."""
        self.tags[self._lanes(slots)] = -1

    def record(self, logits: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
               steps: torch.Tensor) -> None:
        """Keep each candidate row's expected embedding, weighted for its request's
        step `steps` (the steps it ran before this one).  Rows of requests that do not
        smooth weigh 0 and land untagged in the last lane."""
        weight = smooth_weight_at(steps.float(), self.cap[slots])
        rows = self.embedding_rows()
        rows = rows[: logits.shape[-1]]
        probs = self.vocab.softmax(logits.float()).to(rows.dtype)
        expected = self.vocab.sum_over_ranks(probs @ rows)
        lane, entry = self._lanes(slots), positions % self.width
        self.values[lane, entry] = (expected * weight[:, None].to(expected.dtype)).to(self.values.dtype)
        self.tags[lane, entry] = torch.where(weight > 0, positions, -1)

    def add_to(self, embeds: torch.Tensor, input_ids: torch.Tensor, token_source, mask_id: int,
               rebuild: torch.Tensor | None = None) -> torch.Tensor:
        """`embeds` of a step's rows with the kept expected embedding added where the
        row is a canvas position, still masked, with a kept entry (`token_source`:
        StepInputs'; `rebuild`: bool per row reading a past canvas, never smoothed)."""
        in_prompt, _, row_slot, canvas_index = token_source
        lane, entry = self._lanes(row_slot), canvas_index % self.width
        use = ~in_prompt & (input_ids == mask_id) & (self.tags[lane, entry] == canvas_index)
        if rebuild is not None:
            use &= ~rebuild
        added = self.values[lane, entry].to(embeds.dtype)
        return embeds + torch.where(use[:, None], added, 0)

    def forget(self, slots: torch.Tensor, streamed: torch.Tensor) -> None:
        """Positions from `streamed` on went back to the mask (structured outputs):
        what the model said of them before no longer stands."""
        if self.tags is None:
            return
        lane = self._lanes(slots)
        tags = self.tags[lane]
        self.tags[lane] = torch.where(tags >= streamed[:, None], -1, tags)

    def grow_slots(self, capacity: int) -> None:
        old = len(self.cap)
        self.cap = torch.cat([self.cap, self.cap.new_zeros(capacity - old)])
        self.cap_host = np.concatenate([self.cap_host, np.zeros(capacity - old, dtype=np.float32)])
        self.lane_of = torch.cat([self.lane_of, self.lane_of.new_full((capacity - old,), -1)])
        self.lane_host = np.concatenate([self.lane_host, np.full(capacity - old, -1, dtype=np.int64)])

    def _grow(self, lanes: int, width: int) -> None:
        """`lanes` lanes of `width` entries; kept entries move to their place at the new
        width (positions of one block stay apart at any width >= the block)."""
        if (lanes, width) == (self.lanes, self.width):
            return
        rows = self.embedding_rows()
        tags = torch.full((lanes + 1, width), -1, dtype=torch.long, device=self.device)
        values = torch.zeros((lanes + 1, width, rows.shape[1]), dtype=rows.dtype, device=self.device)
        if self.tags is not None:
            lane, old = (self.tags[: self.lanes] >= 0).nonzero(as_tuple=True)
            moved = self.tags[lane, old]
            tags[lane, moved % width] = moved
            values[lane, moved % width] = self.values[lane, old]
        self._free_lanes.extend(range(lanes - 1, self.lanes - 1, -1))
        self.tags, self.values = tags, values
