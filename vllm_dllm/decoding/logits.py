"""The mask-only, chunked logits path.

Only hidden rows whose canvas position still needs a token reach the LM head, at
most `max_rows` logits rows at a time; each chunk is reduced at once to
(token, confidence) by the decoding rule and freed.  The full [tokens, vocab]
tensor never exists.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Project = Callable[[torch.Tensor], torch.Tensor]
Reduce = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def rows_per_chunk(max_rows: int, copies: int) -> int:
    """Canvas positions per chunk when each needs `copies` logits rows (CFG: 2)."""
    if max_rows < copies:
        raise ValueError(f"a chunk of {max_rows} logits rows cannot hold {copies} rows per position")
    return max_rows // copies


def chunked_reduce(
    hidden: torch.Tensor,
    cond_rows: torch.Tensor,
    positions: torch.Tensor,
    project: Project,
    reduce: Reduce,
    max_rows: int,
    *,
    uncond_rows: torch.Tensor | None = None,
    cfg_scale: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Project `hidden[cond_rows]` chunk by chunk and reduce each chunk.

    With `uncond_rows`, each chunk also projects the unconditional rows and combines
    them as classifier-free guidance: un + (cfg + 1) * (cond - un).
    """
    if len(cond_rows) == 0:
        empty = torch.empty(0, dtype=torch.long, device=hidden.device)
        return empty, torch.empty(0, dtype=torch.float32, device=hidden.device)
    copies = 1 if uncond_rows is None else 2
    step = rows_per_chunk(max_rows, copies)
    tokens, confidence = [], []
    for start in range(0, len(cond_rows), step):
        end = start + step
        if uncond_rows is None:
            logits = project(hidden[cond_rows[start:end]])
        else:
            rows = torch.cat([cond_rows[start:end], uncond_rows[start:end]])
            both = project(hidden[rows])
            cond, uncond = both.chunk(2)
            logits = uncond + (cfg_scale + 1) * (cond - uncond)
            del both, cond, uncond
        chunk_tokens, chunk_conf = reduce(logits, positions[start:end])
        del logits
        tokens.append(chunk_tokens)
        confidence.append(chunk_conf)
    return torch.cat(tokens), torch.cat(confidence)
