"""Lazy chunking of a step's widest activations along its tokens (Mosaic's memory path).

A step's transient peak grows with its query tokens: a Refresh of LLaDA-8B's shape over
16k tokens holds 1.2 GB of FFN intermediate (gate and up, then the activation, 3 x
12,288 wide, bf16), and vLLM's memory profile reserves for the largest step, so every
such byte is KV cache that is not there.  The LM head already projects at most
`max_num_logits` rows at a time; that tile is the step's activation budget.  An FFN
whose intermediate for the step would exceed it runs over balanced chunks of the
step's tokens, each within it; a step that fits (every Reuse step, a short Refresh)
runs whole, so chunking costs nothing where it is not needed.  The routed experts of
the MoE models chunk the same way, their per-row intermediate counted as top-k experts'
gate, up and activation.  Rows are independent through an FFN, so chunking changes no
token (tested through the engine).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

LOGITS_BYTES = 4  # the tile is counted as float32 logits


def logits_tile_bytes(max_num_logits: int, vocab_rows: int) -> int:
    """Bytes of one LM-head tile: `max_num_logits` rows of this rank's vocabulary."""
    return max_num_logits * vocab_rows * LOGITS_BYTES


def rows_within(budget_bytes: int, bytes_per_row: int) -> int:
    """The most rows whose activations fit `budget_bytes` (at least one)."""
    return max(1, budget_bytes // bytes_per_row)


def balanced_chunks(rows: int, max_rows: int) -> list[tuple[int, int]]:
    """[start, stop) ranges covering `rows`: as few chunks as `max_rows` allows, of
    sizes differing by at most one (no small remainder chunk)."""
    if rows <= 0:
        return []
    count = -(-rows // max_rows)
    size, extra = divmod(rows, count)
    chunks, start = [], 0
    for i in range(count):
        stop = start + size + (i < extra)
        chunks.append((start, stop))
        start = stop
    return chunks


def chunked_rows(x: torch.Tensor, max_rows: int | None, project: Callable[[torch.Tensor], torch.Tensor]
                 ) -> torch.Tensor:
    """`project(x)` for a row-wise `project` whose output rows have x's shape, over
    balanced chunks of x's rows when there are more than `max_rows` (None: whole)."""
    if max_rows is None or len(x) <= max_rows:
        return project(x)
    out = torch.empty_like(x)
    for start, stop in balanced_chunks(len(x), max_rows):
        out[start:stop] = project(x[start:stop])
    return out


class ChunkedRows:
    """Mixed into a module whose step holds `row_elements` elements of activation per
    row (in the dtype vLLM built it in), both recorded by `chunk_rows` in its
    __init__: `limit_activation` sets the rows a chunk may hold within the step's
    budget, and `forward` runs `chunked_rows(x, self.max_rows, ...)`."""

    max_rows: int | None = None  # None: every step runs whole

    def chunk_rows(self, row_elements: int) -> None:
        self.row_elements = row_elements
        self.activation_bytes = torch.get_default_dtype().itemsize

    def limit_activation(self, budget_bytes: int) -> None:
        self.max_rows = rows_within(budget_bytes, self.row_elements * self.activation_bytes)


class RoutedRows(ChunkedRows):
    """Routed experts: a row holds its `top_k` experts' gate, up and activation, each
    `expert_width` wide, counted whole (under tensor or expert parallelism a rank
    holds less)."""

    def routed_rows(self, top_k: int, expert_width: int) -> None:
        self.chunk_rows(3 * top_k * expert_width)


def limit_activations(model: nn.Module, budget_bytes: int) -> int:
    """Give every module of `model` that can chunk its activations the step's budget
    (`limit_activation(bytes)`); returns how many took it."""
    modules = [m for m in model.modules() if hasattr(m, "limit_activation")]
    for module in modules:
        module.limit_activation(budget_bytes)
    return len(modules)
