"""How a grammar can end from where it stands: the tokens of a short completion.

A diffusion request knows its canvas before it starts, so a constrained request
can always end with a complete document when the canvas leaves room for one: the
scheduler keeps the tokens a completion needs within the positions left, and
forces the completion when no position is left to spare (scheduler/grammar.py).

A completion is spelled with single-character tokens (every byte-level vocabulary
has them) and, where the grammar forces a string (a tool call's envelope, a key),
that string's own tokens; it ends with a stop token.  Two searches over a grammar's own
accept/rollback (vLLM's StructuredOutputGrammar; the grammar is left where it
stood):

* `greedy_completion`: one path, cheap (a few tries per token): at each point the
  first of the stop tokens, then the closing characters, that the grammar accepts,
  never the same character twice in a row (inside a string every closing character
  but the quote is content, and the quote comes first), then the other structural
  characters, else the lowest token the mask allows that the path has not fallen
  back to before.  An upper bound on what the grammar needs;
* `shortest_completion`: iterative deepening over the structural characters (and
  the same fallback), within a budget of grammar moves: the fewest tokens, used
  when the bound says the canvas is nearly spent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

# Tried in this order by the greedy path: a quote (ends a string; where a value starts,
# the shortest one), ends of objects and arrays, then a digit.
CLOSERS = '"}])0'
# The characters the exact search branches over: JSON's structure, a digit, a letter.
STRUCTURE = '"}]),:0a'
SEARCH_BUDGET = 4096  # grammar moves (an accept and its rollback) per shortest search


@dataclass(frozen=True)
class Alphabet:
    """The candidate tokens of completions for one tokenizer and request."""

    stop_ids: tuple[int, ...]
    closers: tuple[int, ...]  # single-character tokens of CLOSERS, in that order
    structure: tuple[int, ...]  # single-character tokens of STRUCTURE

    def with_stops(self, stop_ids) -> "Alphabet":
        return Alphabet(tuple(sorted(stop_ids)), self.closers, self.structure)


def single_character_tokens(tokenizer, characters: str) -> tuple[int, ...]:
    """The token of each character that the tokenizer spells with one token alone."""
    tokens = []
    for character in characters:
        ids = tokenizer.encode(character, add_special_tokens=False)
        if len(ids) == 1 and ids[0] not in tokens:
            tokens.append(int(ids[0]))
    return tuple(tokens)


def alphabet_of(tokenizer) -> Alphabet:
    return Alphabet((), single_character_tokens(tokenizer, CLOSERS), single_character_tokens(tokenizer, STRUCTURE))


# The tokens of the string a grammar forces from where it stands (grammar.jump_tokens).
Forced = Callable[[], list[int]]


class _Walk:
    """A grammar moved token by token, counting its moves, and put back at the end."""

    def __init__(self, grammar, req_id: str, bitmask: torch.Tensor, budget: int, forced: Forced | None = None):
        self.grammar, self.req_id, self.bitmask = grammar, req_id, bitmask
        self.budget = budget
        self.depth = 0
        self.forced = forced

    def step(self, token: int) -> bool:
        # Tried first: vLLM's accept_tokens logs an error for a token it refuses.
        self.budget -= 1
        if self.grammar.validate_tokens([token]) and self.grammar.accept_tokens(self.req_id, [token]):
            self.depth += 1
            return True
        return False

    def back(self, n: int = 1) -> None:
        if n:
            self.grammar.rollback(n)
            self.depth -= n

    def take_forced(self) -> list[int]:
        """The tokens of the string the grammar forces from here, stepped: a tag's or
        a key's characters, whatever the alphabet holds; [] where it forces none or
        refuses that string's tokens."""
        tokens = self.forced() if self.forced is not None else []
        for taken, token in enumerate(tokens):
            if not self.step(token):
                self.back(taken)
                return []
        return tokens

    def ends(self, stop_ids) -> int | None:
        """A stop token the grammar accepts here, if one."""
        for token in stop_ids:
            if self.step(token):
                self.back()
                return token
        return None

    def first_allowed(self, skip: tuple[int, ...]) -> int | None:
        """The lowest token the grammar's mask allows here, other than `skip`."""
        self.grammar.fill_bitmask(self.bitmask, 0)
        words = self.bitmask[0].numpy()
        for word in np.flatnonzero(words):
            bits = int(words[word]) & 0xFFFFFFFF
            for bit in range(32):
                token = int(word) * 32 + bit
                if (bits >> bit) & 1 and token not in skip:
                    return token
        return None


def greedy_completion(grammar, req_id: str, alphabet: Alphabet, limit: int,
                      bitmask: torch.Tensor, forced: Forced | None = None) -> list[int] | None:
    """Tokens that take the grammar from where it stands to a stop token (the last
    of them), at most `limit`; None when this path finds none within it.  `forced`:
    the grammar's forced string, taken whole wherever it has one."""
    if grammar.is_terminated():
        return []
    walk = _Walk(grammar, req_id, bitmask, budget=limit * (len(alphabet.structure) + len(alphabet.stop_ids) + 2),
                 forced=forced)
    candidates = alphabet.closers + tuple(t for t in alphabet.structure if t not in alphabet.closers)
    path: list[int] = []
    fallbacks: list[int] = []
    try:
        while len(path) < limit:
            stop = walk.ends(alphabet.stop_ids)
            if stop is not None:
                return [*path, stop]
            taken = walk.take_forced()
            if taken:
                path.extend(taken)
                continue
            last = path[-1] if path else None
            token = next((t for t in candidates if t != last and walk.step(t)), None)
            if token is None:
                # Never the same fallback twice: it would be whitespace a grammar allows anywhere.
                token = walk.first_allowed((*alphabet.stop_ids, *fallbacks))
                if token is None or not walk.step(token):
                    return None
                fallbacks.append(token)
            path.append(token)
        return None
    finally:
        walk.back(walk.depth)


def shortest_completion(grammar, req_id: str, alphabet: Alphabet, limit: int, bitmask: torch.Tensor,
                        budget: int = SEARCH_BUDGET, forced: Forced | None = None) -> list[int] | None:
    """The fewest tokens (single characters, the grammar's forced strings, and a stop
    token last) that take the grammar to a stop token, at most `limit`; None when
    there are none within it or the search ran out of budget."""
    if grammar.is_terminated():
        return []
    walk = _Walk(grammar, req_id, bitmask, budget, forced)
    path: list[int] = []

    def search(depth: int) -> bool:
        # depth: tokens still allowed, the stop token among them
        stop = walk.ends(alphabet.stop_ids)
        if stop is not None:
            path.append(stop)
            return True
        if depth <= 1 or walk.budget <= 0:
            return False
        taken = walk.take_forced()
        if taken:  # no choice to branch over
            if len(taken) < depth:
                path.extend(taken)
                if search(depth - len(taken)):
                    return True
                del path[-len(taken):]
            walk.back(len(taken))
            return False
        moved = False
        for token in alphabet.structure:
            if walk.budget <= 0:
                return False
            if walk.step(token):
                moved = True
                path.append(token)
                if search(depth - 1):
                    return True
                path.pop()
                walk.back()
        if not moved:
            token = walk.first_allowed(alphabet.stop_ids)
            if token is not None and walk.step(token):
                path.append(token)
                if search(depth - 1):
                    return True
                path.pop()
                walk.back()
        return False

    try:
        for depth in range(1, limit + 1):
            if search(depth):
                return list(path)
            if walk.budget <= 0:
                return None
        return None
    finally:
        walk.back(walk.depth)


def need(grammar, req_id: str, alphabet: Alphabet, left: int, bitmask: torch.Tensor,
         forced: Forced | None = None) -> int | None:
    """How many tokens the grammar needs to complete its document, stop token
    included, if it can within `left` positions (the stop token may fall past them:
    a canvas that ends with the document is fine); None if it cannot.  The greedy
    path's length, or the search's when the greedy path does not fit."""
    for search in (greedy_completion, shortest_completion):
        tokens = search(grammar, req_id, alphabet, left + 1, bitmask, forced=forced)
        if tokens is not None:
            return len(tokens)
    return None


def closing(grammar, req_id: str, alphabet: Alphabet, left: int, bitmask: torch.Tensor,
            now: bool = False, forced: Forced | None = None) -> list[int]:
    """The tokens to commit now so that the document completes within the `left`
    positions the canvas has: the shortest completion when it needs all of them (its
    stop token, when one more, falls off the canvas), or when `now`; [] while a
    position is left to spare, or when no completion fits at all."""
    greedy = greedy_completion(grammar, req_id, alphabet, left + 1, bitmask, forced)
    if greedy is not None and len(greedy) < left and not now:
        return []
    shortest = shortest_completion(grammar, req_id, alphabet, left + 1, bitmask, forced=forced)
    tokens = shortest if shortest is not None else greedy
    if tokens is None or len(tokens) < left and not now:
        return []
    return tokens[:left]
