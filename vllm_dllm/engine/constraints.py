"""Structured outputs on the engine side: what the scheduler's grammars decided for a
step, and how it reaches the canvases and the LM-head rows.  Imports no vLLM.

The grammars live with the scheduler (vLLM's structured-output manager), which sees
each request's final tokens as they stream and validates them (scheduler/grammar.py).
Per step it sends a `GrammarStep`:

* `returned`: a request whose streamed tokens broke its grammar at canvas position
  p: every committed token from p on goes back to the mask, and the request restarts
  the schedule of the block holding p (so that block commits its masks again, the
  frontier among them);
* `forced`: tokens the grammar allows alone at a request's frontier (the first
  position after its accepted prefix), committed before the forward without
  spending a step (jump-forward);
* `masked` + `bitmask`: each listed request's grammar mask for its frontier after
  those, applied to that position's logits row before the rule ranks it, so the
  frontier always commits a token the grammar accepts.

Positions right of the frontier are decoded as usual; the scheduler checks them
when the prefix reaches them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class GrammarStep:
    returned: dict[str, int] = field(default_factory=dict)  # request -> first position returned to the mask
    forced: dict[str, list[int]] = field(default_factory=dict)  # request -> tokens forced at its frontier
    masked: list[str] = field(default_factory=list)  # requests whose frontier row is masked, in bitmask order
    bitmask: np.ndarray | None = None  # int32 [len(masked), words]: bit v of a row allows token v

    def __bool__(self) -> bool:
        return bool(self.returned or self.forced or self.masked)


@dataclass
class FrontierMasks:
    """One step's masks, on the device: for each request slot its bitmask row (-1:
    none) and the canvas position the row applies to."""

    row: torch.Tensor  # long [capacity]
    frontier: torch.Tensor  # long [capacity]
    bitmask: torch.Tensor  # int32 [rows, words]

    def rows_for(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The bitmask row of each candidate (request slot, canvas position): its
        request's row where the position is the request's frontier, else -1."""
        row = self.row[slots]
        return torch.where(positions == self.frontier[slots], row, -1)


def block_of(positions: np.ndarray, prompt_len: np.ndarray, block_length: np.ndarray, segment: np.ndarray) -> np.ndarray:
    """The canvas block holding each canvas position.  A block-causal request's
    blocks (segment: its block length) are aligned to the whole sequence, so its first
    canvas block is cut short by the prompt's partial last block; other requests'
    blocks start at the canvas."""
    causal = segment > 0
    lead = np.where(causal, prompt_len % np.maximum(segment, 1), 0)
    return (positions + lead) // np.where(causal, segment, block_length)


def return_to_mask(canvas: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor, mask_id: int, pad: int) -> None:
    """Every committed position p >= starts[i] of canvas row slots[i] back to the
    mask (padding past the generation length stays)."""
    rows = canvas[slots]
    columns = torch.arange(canvas.shape[1], device=canvas.device)
    back = (columns >= starts[:, None]) & (rows != pad)
    canvas[slots] = torch.where(back, mask_id, rows)


def frontier_masks(step: GrammarStep, slots: dict[str, int], frontier: dict[str, int], capacity: int,
                   device: torch.device) -> FrontierMasks | None:
    """The device form of `step`'s masks for the requests the engine holds;
    `frontier`: each request's first position after its accepted prefix and the
    tokens forced there."""
    present = [(i, r) for i, r in enumerate(step.masked) if r in slots]
    if not present or step.bitmask is None:
        return None
    row = np.full(capacity, -1, dtype=np.int64)
    where = np.zeros(capacity, dtype=np.int64)
    for index, req_id in present:
        row[slots[req_id]] = index
        where[slots[req_id]] = frontier[req_id]
    return FrontierMasks(
        row=torch.from_numpy(row).to(device),
        frontier=torch.from_numpy(where).to(device),
        bitmask=torch.from_numpy(np.ascontiguousarray(step.bitmask, dtype=np.int32)).to(device),
    )
