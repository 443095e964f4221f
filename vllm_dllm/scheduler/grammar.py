"""Structured outputs in the scheduler: vLLM's grammars over diffusion canvases.

vLLM's structured-output manager compiles each request's grammar (asynchronously;
the request waits until it is ready) and vLLM's scheduler feeds it every token it
streams (`accept_tokens`).  A diffusion step streams a request's newly final
tokens, several at once, and only the first of them, the frontier, was decoded
under the grammar's mask (engine/constraints.py).  So:

* after a step, before vLLM sees them, a constrained request's new tokens are
  validated (`validate_streamed`): the longest prefix the grammar accepts streams,
  and from the first token it rejects on every committed token goes back to the
  mask (`GrammarStep.returned`);
* before a step, each scheduled constrained request's mask for its frontier is
  filled, and what its grammar forces there is committed without a step, the mask
  filled again behind it (`plan_frontiers`, jump-forward): the string the backend
  finds forced (xgrammar), tokenized, or else a token the mask allows alone.  A
  mask that allows only stop tokens forces one: the rest of the canvas is end of
  text;
* the canvas's end is known, so a document always completes where the canvas has
  room for it (scheduler/completion.py): after a step, a prefix whose completion no
  longer fits in the positions left is cut back to one whose completion does (the
  rest goes back to the mask), and before a step, a frontier with no position to
  spare is forced the shortest completion.

The grammar objects are vLLM's `StructuredOutputGrammar` (fill_bitmask,
accept_tokens, rollback, is_terminated); forced tokens are accepted to find the
next mask and rolled back, so the grammar always stands at the streamed prefix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from vllm_dllm.engine.constraints import GrammarStep
from vllm_dllm.scheduler.completion import Alphabet, closing


@dataclass
class Frontier:
    """What planning one constrained request's frontier needs."""

    req_id: str
    grammar: object  # vLLM's StructuredOutputGrammar
    room: int  # canvas positions from its frontier to the end of the frontier's block
    stop_ids: frozenset[int]
    jump: Callable[[], list[int]] | None = None  # the string the grammar forces, as tokens
    # Completing the document in time (scheduler/completion.py); no alphabet: never forced.
    left: int = 0  # canvas positions from its frontier to the canvas's end
    alphabet: Alphabet | None = None
    need: int | None = None  # tokens the grammar needs to complete from its frontier, if known
    close_now: bool = False  # complete the document now (its last tokens outgrew the room left)


def jump_tokens(grammar, tokenizer) -> Callable[[], list[int]] | None:
    """The tokens of the string a grammar forces from where it stands, where the
    backend finds one (xgrammar's matcher: `find_jump_forward_string`); None for
    backends without.  The string is tokenized on its own, so its tokens may not be
    the ones the model would pick in context; the planner keeps only what the
    grammar accepts."""
    find = getattr(getattr(grammar, "matcher", None), "find_jump_forward_string", None)
    if find is None:
        return None

    def jump() -> list[int]:
        text = find()
        return list(tokenizer.encode(text, add_special_tokens=False)) if text else []

    return jump


# Backends whose grammars roll back any number of tokens; outlines' guide keeps only
# a few states, too few to search for a completion.
DEEP_ROLLBACK_BACKENDS = ("xgrammar", "guidance")


def rolls_back_deeply(grammar) -> bool:
    """Whether a vLLM grammar (its backend module is `backend_<name>`) can try out
    a completion and take it back."""
    return type(grammar).__module__.rsplit(".", 1)[-1].removeprefix("backend_") in DEEP_ROLLBACK_BACKENDS


def canvas_blocks(options) -> tuple[int, int]:
    """(offset, length) of a request's canvas blocks: block k starts at canvas
    position offset + k * length.  A block-causal request's blocks are aligned to
    the whole sequence (offset: minus the prompt's partial last block)."""
    if getattr(options, "block_causal", False):
        return -options.lead, options.block_length
    return 0, options.gen_length // options.num_blocks


def canvas_block(options, position: int) -> int:
    offset, length = canvas_blocks(options)
    return (position - offset) // length


def sole_token(row: np.ndarray, stop_ids: frozenset[int]) -> int | None:
    """The token a packed bitmask row (int32 words) allows alone, or the lowest stop
    token when it allows stop tokens only; None otherwise."""
    words = np.flatnonzero(row)
    if len(words) == 0 or len(words) > max(1, len(stop_ids)):
        return None
    allowed = [int(w) * 32 + bit for w in words for bit in range(32) if (int(row[w]) >> bit) & 1]
    if len(allowed) == 1:
        return allowed[0]
    if stop_ids and all(token in stop_ids for token in allowed):
        return min(allowed)
    return None


def plan_frontiers(frontiers: list[Frontier], bitmask: torch.Tensor) -> GrammarStep:
    """Forced tokens and frontier masks of a step's constrained requests; row i of
    `bitmask` (at least len(frontiers) rows) is filled for request i.  Forced: what
    the grammar allows alone, and the completion of the document once the canvas has
    no position to spare."""
    step = GrammarStep()
    scratch = torch.zeros((1, bitmask.shape[1]), dtype=bitmask.dtype)
    for i, frontier in enumerate(frontiers):
        grammar = frontier.grammar
        if grammar.is_terminated():
            continue
        forced: list[int] = []
        while True:
            grammar.fill_bitmask(bitmask, i)
            room = frontier.room - len(forced)
            if room <= 0:
                break
            tokens = grammar.validate_tokens(frontier.jump())[:room] if frontier.jump is not None else []
            if not tokens:
                token = sole_token(bitmask[i].numpy(), frontier.stop_ids)
                tokens = [] if token is None else [token]
            left = frontier.left - len(forced)
            if not tokens and frontier.alphabet is not None and (
                    frontier.close_now or frontier.need is None or frontier.need >= left):
                tokens = closing(grammar, frontier.req_id, frontier.alphabet, left, scratch, frontier.close_now,
                                 frontier.jump)[:room]
            if not tokens or not grammar.accept_tokens(frontier.req_id, tokens):
                break
            forced.extend(tokens)
            if grammar.is_terminated():
                break  # a stop token ends the request; the row's mask is never read
        if forced:
            grammar.rollback(len(forced))
            step.forced[frontier.req_id] = forced
        step.masked.append(frontier.req_id)
    step.bitmask = bitmask[: len(frontiers)].numpy().copy()
    if len(step.masked) < len(frontiers):  # terminated grammars take no row
        rows = [i for i, f in enumerate(frontiers) if f.req_id in set(step.masked)]
        step.bitmask = step.bitmask[rows]
    return step


def stop_allowed_after(grammar, req_id: str, valid: list[int], token: int, bitmask: torch.Tensor) -> bool:
    """Whether the grammar's mask allows stop token `token` after the accepted
    prefix `valid` (the grammar is left where it stood).  Backends differ on stop
    tokens: guidance's matcher stops as soon as its grammar cannot continue, then
    validates nothing, not even the end of text its own mask asks for."""
    if valid and not grammar.accept_tokens(req_id, valid):
        return False
    grammar.fill_bitmask(bitmask, 0)
    if valid:
        grammar.rollback(len(valid))
    return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)


def ends_request(valid: list[int], stop_ids: frozenset[int]) -> bool:
    """The accepted prefix ends with a stop token: vLLM finishes the request there."""
    return bool(valid) and valid[-1] in stop_ids
