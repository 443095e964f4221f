"""How many KV slots a request holds: the whole sequence, or for the sparse cache
the positions each head keeps plus the active block.

Pure arithmetic shared by the scheduler (blocks reserved at admission) and the step
engine (where each sequence's slots start and how many a Reuse step attends over),
so both always agree.

A sparse request's slots, per sequence (a CFG twin has its own, after the first
copy's): slots 0..kept-1 hold, for every KV head separately, the K/V of the
positions that head kept at the last Refresh; slots kept..kept+span-1 hold the
Reuse step's queries (the active block, and for a shifted model the position before
it), written fresh at every step.  `kept = ceil(retention x (sequence - span))`.
"""

from __future__ import annotations

import math

from vllm_dllm.options import DecodeOptions, sequence_copies
from vllm_dllm.phases import query_lead

# retention x positions is rounded up, but a product such as 0.3 x 480 lands a hair
# above its integer in binary floating point; it is not a position more.
_ROUNDING_SLACK = 1e-9


def block_span(options: DecodeOptions) -> int:
    """Query positions of a sparse Reuse step: the block and its lead."""
    return options.gen_length // options.num_blocks + query_lead(options)


def kept_positions(options: DecodeOptions, prompt_len: int) -> int:
    """Positions each KV head keeps from outside the Reuse queries (0 unless sparse)."""
    if options.cache != "sparse":
        return 0
    context = prompt_len + options.gen_length - block_span(options)
    return min(context, math.ceil(options.retention * context - _ROUNDING_SLACK))


def sequence_slots(options: DecodeOptions, prompt_len: int) -> int:
    """KV slots of one sequence of the request."""
    if options.cache != "sparse":
        return prompt_len + options.gen_length
    return kept_positions(options, prompt_len) + block_span(options)


def request_slots(options: DecodeOptions, prompt_len: int) -> int:
    """KV slots the request holds from admission to its end (both CFG copies)."""
    return sequence_slots(options, prompt_len) * sequence_copies(options)
