"""Grammar bitmasks on logits rows: vLLM's structured-output backends pack a mask per
row as int32 words (bit v % 32 of word v // 32 allows token v)."""

from __future__ import annotations

import torch


def allowed_tokens(bitmask: torch.Tensor, vocab: int, columns: torch.Tensor | None = None) -> torch.Tensor:
    """bool [rows, vocab] from packed int32 rows [rows, words] (bit v % 32 of word
    v // 32 allows token v); logits columns past the mask's bits are never allowed.
    `columns`: the token id of each column (a vocabulary shard's), default 0..vocab-1."""
    if columns is None:
        columns = torch.arange(vocab, device=bitmask.device)
    words = bitmask.shape[1]
    word = bitmask[:, (columns >> 5).clamp(max=words - 1)]
    bit = (word >> (columns & 31).to(word.dtype)) & 1
    return (bit == 1) & (columns < words * 32)


def mask_rows(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor,
              columns: torch.Tensor | None = None) -> torch.Tensor:
    """Logits with the grammar's disallowed tokens at -inf in every row i whose
    `rows[i]` names a bitmask row (-1: the row is left as it is).  `columns`: the
    token id of each logits column, when the logits are a vocabulary shard."""
    allowed = allowed_tokens(bitmask[rows.clamp(min=0)], logits.shape[1], columns)
    return logits.masked_fill((rows >= 0)[:, None] & ~allowed, float("-inf"))
