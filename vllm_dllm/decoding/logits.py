"""The mask-only, chunked logits path, over the candidates of the whole batch.

Only hidden rows whose canvas position needs a token reach the LM head, at most
`max_rows` logits rows at a time whichever requests they belong to; each chunk is
reduced at once to (token, confidence) by the rule and freed.  The full
[tokens, vocab] tensor never exists.  Under tensor parallelism `project` gives this
rank's vocabulary columns and the rule reduces them through its state's
`VocabShard` (decoding/vocab.py): no rank holds a whole logits row either.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_dllm.decoding.base import BatchedRule
from vllm_dllm.decoding.logprobs import LogprobsCollector
from vllm_dllm.decoding.grammar_mask import mask_rows
from vllm_dllm.decoding.vocab import WHOLE, Vocab

Project = Callable[[torch.Tensor], torch.Tensor]
# smooth(logits, slots, positions): reads a chunk's logits as the model gave them.
Smooth = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class LMHead:
    """Hidden rows to logits rows (`project`), and the vocabulary columns those
    rows hold: the whole vocabulary, or this rank's shard under TP."""

    project: Project
    vocab: Vocab = WHOLE


def rows_per_chunk(max_rows: int, copies: int) -> int:
    """Candidates per chunk when each needs `copies` logits rows (CFG: 2)."""
    if max_rows < copies:
        raise ValueError(f"a chunk of {max_rows} logits rows cannot hold {copies} rows per position")
    return max_rows // copies


def chunked_reduce(
    hidden: torch.Tensor,
    cond_rows: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    project: Project,
    rule: BatchedRule,
    max_rows: int,
    *,
    uncond_rows: torch.Tensor | None = None,
    cfg_scale: torch.Tensor | None = None,
    logprobs: LogprobsCollector | None = None,
    grammar: tuple[torch.Tensor, torch.Tensor] | None = None,
    smooth: Smooth | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Project `hidden[cond_rows]` chunk by chunk and reduce each chunk with `rule`.

    With `uncond_rows` (one per candidate; a candidate without guidance names its
    conditional row again and has scale 0), each chunk also projects the
    unconditional rows and combines them as classifier-free guidance:
    un + (cfg + 1) * (cond - un), which is exactly `cond` when both rows are one.
    With `logprobs`, each chunk's logits as the model gave them (guided) are kept
    until the rule has chosen its tokens, and their logprob rows collected.
    With `grammar` = (bitmask [n, words], row per candidate, -1 for none), a
    candidate's logits keep only the tokens its bitmask row allows (after guidance,
    before the rule and the logprobs: the distribution the token is drawn from).
    With `smooth` (IterSmooth, engine/iter_smooth.py), each chunk's logits reach it
    at the same point, before the rule edits them.
    """
    count = len(cond_rows)
    if count == 0:
        empty = torch.empty(0, dtype=torch.long, device=hidden.device)
        return empty, torch.empty(0, dtype=torch.float32, device=hidden.device)
    step = rows_per_chunk(max_rows, 1 if uncond_rows is None else 2)
    tokens, confidence = [], []
    for start in range(0, count, step):
        chunk = slice(start, start + step)
        if uncond_rows is None:
            logits = project(hidden[cond_rows[chunk]])
        else:
            rows = torch.cat([cond_rows[chunk], uncond_rows[chunk]])
            cond, uncond = project(hidden[rows]).chunk(2)
            logits = uncond + (cfg_scale[chunk, None] + 1) * (cond - uncond)
            del cond, uncond
        if grammar is not None:
            logits = mask_rows(logits, grammar[0], grammar[1][chunk], rule.state.vocab.columns(logits))
        if smooth is not None:
            smooth(logits, slots[chunk], positions[chunk])
        raw = logits.clone() if logprobs is not None else None  # the rule may edit logits in place
        chunk_tokens, chunk_conf = rule.reduce(logits, slots[chunk], positions[chunk])
        del logits
        if raw is not None:
            logprobs.add(raw, chunk_tokens)
            del raw
        tokens.append(chunk_tokens)
        confidence.append(chunk_conf)
    if len(tokens) == 1:
        return tokens[0], confidence[0]
    return torch.cat(tokens), torch.cat(confidence)
