"""Comparisons against the oracle that hold on every CPU.

A reference run that meets an exact confidence tie (top-k cut or argmax) may pick
either side, so its tokens are not compared.  Which prompts tie depends on the CPU's
GEMM rounding (Intel with AMX and AMD EPYC differ; a trained model's confidences
saturate at 1.0 in float32 and tie often), so a fixed sample of prompts compares a
varying number of them.  These helpers draw fresh prompts until the wanted number of
tie-free comparisons is reached, and fail clearly if a bounded number of draws does
not get there.
"""

from __future__ import annotations

from typing import Callable, Sequence, TypeVar

Case = TypeVar("Case")

MAX_DRAWS = 8


def compare_each_case(
    cases: Sequence[Case],
    compare_draw: Callable[[int, list[Case]], list[Case]],
    max_draws: int = MAX_DRAWS,
) -> int:
    """Every case compared once on a tie-free draw.

    `compare_draw(draw, pending)` draws fresh prompts for the pending cases (the draw
    index seeds them), compares the tie-free ones (asserting inside) and returns the
    cases whose reference tied.  Returns the number of draws used.
    """
    pending = list(cases)
    for draw in range(max_draws):
        pending = compare_draw(draw, pending)
        if not pending:
            return draw + 1
    raise AssertionError(
        f"the reference tied on each of {max_draws} draws for {len(pending)} case(s): {pending!r}; "
        "exact ties should be occasional, so the model or the reference is degenerate"
    )


def compare_until(needed: int, compare_draw: Callable[[int], int], max_draws: int = MAX_DRAWS) -> int:
    """Draw until `needed` tie-free comparisons were made.

    `compare_draw(draw)` draws fresh prompts (seeded by the draw index), compares the
    tie-free ones (asserting inside) and returns how many it compared.  Returns the
    total compared.
    """
    compared = 0
    for draw in range(max_draws):
        compared += compare_draw(draw)
        if compared >= needed:
            return compared
    raise AssertionError(
        f"only {compared} of {needed} comparisons were tie-free in {max_draws} draws; "
        "exact ties should be occasional, so the model or the reference is degenerate"
    )
