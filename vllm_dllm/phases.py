"""Refresh / Reuse: which positions of a request are queries at a given step.

A Refresh step runs the whole sequence and writes every position's K/V into the
request's KV blocks.  A Reuse step runs only part of the sequence; every other
position's K/V is read from the blocks as the last Refresh left them (stale by
design), and nothing is written.  Policies (Fast-dLLM's caches):
  none    every step is a Refresh (exact decoding)
  prefix  Reuse queries run from the active block's start to the end of the sequence
  dual    Reuse queries are the active block only
  sparse  dual's phases; the cache keeps, per KV head, a share of the positions
          outside the block (attention/sparse.py)
  vicinity  dual's, with `vicinity` positions on each side of the block also run
          (dInfer's Vicinity Refresh): the cache near the block is always fresh, and
          a vicinity covering the sequence reads nothing stale (exact)
A step refreshes when the request has no cache (its first step), at steps
0..`delay_step` of each block (Sparse-dLLM's delayed update: the first steps of a
block run in full and the cache kept is the one filled at step `delay_step`, once
the block's first tokens are decoded), and every `refresh_interval` steps after
that.  Scheduler and runner both call this function, so they agree on costs.

Preemption frees a request's KV blocks.  If its next step is a Refresh nothing is
lost; if it is a Reuse, the step first reruns the canvas of the request's last
Refresh (kept by the engine) over the whole sequence to rebuild the cache exactly as
it was, then runs the Reuse: a resumed request decodes what it would have decoded
without preemption, at the cost of one sequence more in that step.

Block-causal models (LLaDA2.x) have no Refresh/Reuse: a block attends to itself and
to earlier blocks only, so the K/V of finished blocks are exact.  A step's queries
are whole blocks, each a segment attending up to its own end: normally the active
block; at a block's first step also the block just finished (its final K/V go into
the pool in the same forward, never in a forward of their own); at a request's first
step, or after preemption freed its K/V, every block from the first one whose K/V
are not in the pool (the prompt's whole blocks, any finished ones, then the active
one).  The queries are a contiguous run of blocks, so a phase is still one query
range; the engine cuts it into blocks.

Such a prefill may start past 0 (`prefilled`: the prompt's whole blocks a prefix
cache hit holds, scheduler/prefix_cache.py) and is chunked under a token budget
(`chunk`, the server's prefill chunk): while the blocks left to run with the active
one exceed it, a step runs the next whole blocks that fit and decodes nothing
(`decodes` False); the step whose run fits also denoises the active block.  K/V of a
block depend only on it and earlier blocks, so a chunked or cached prefix is the one
a single forward would write.

A request's progress is (block, step within the block): under the fixed schedule
every block takes `steps_per_block` steps; under a parallel decoding rule a block
ends as soon as it has no masks left, so the engine reports the progress after each
step and the phase follows it.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_dllm.options import DecodeOptions, DreamOptions


@dataclass(frozen=True)
class StepPhase:
    refresh: bool
    query_start: int  # first query position, in sequence coordinates
    query_end: int  # one past the last
    decodes: bool = True  # False: a prefill chunk, which only writes K/V

    @property
    def num_queries(self) -> int:
        return self.query_end - self.query_start


def step_phase(options: DecodeOptions, step: int, prompt_len: int, has_cache: bool) -> StepPhase:
    """The phase at global step `step` of the fixed schedule."""
    spb = options.steps_per_block
    return block_phase(options, step // spb, step % spb, prompt_len, has_cache)


def query_lead(options: DecodeOptions) -> int:
    """Positions a Reuse step also runs before its block: Dream predicts position j
    from the hidden state at j - 1, so a block's first position needs the row before."""
    return 1 if isinstance(options, DreamOptions) else 0


def is_block_causal(options: DecodeOptions) -> bool:
    return getattr(options, "block_causal", False)


def keeps_cache_over_preemption(options: DecodeOptions) -> bool:
    """Whether a preempted request rebuilds its cache from a kept canvas (Refresh /
    Reuse policies) rather than recomputing its prefix from its tokens (block-causal)."""
    return not is_block_causal(options)


def prefill_chunk_blocks(block_length: int, chunk: int) -> int:
    """Whole blocks a prefill chunk runs (at least one); 0: no chunking."""
    return max(chunk // block_length, 1) if chunk > 0 else 0


def block_causal_phase(
    block_length: int, prompt_len: int, block: int, block_step: int, has_cache: bool,
    prefilled: int = 0, chunk: int = 0,
) -> StepPhase:
    """Queries of step `block_step` of canvas block `block` of a block-causal request
    whose pool holds the K/V of its first `prefilled` positions (without a cache)."""
    active = prompt_len - prompt_len % block_length + block * block_length
    end = active + block_length
    if has_cache:
        start = active - block_length if block_step == 0 and block > 0 else active
        return StepPhase(False, start, end)
    run = prefill_chunk_blocks(block_length, chunk) * block_length
    if run and end - prefilled > run:
        return StepPhase(True, prefilled, prefilled + run, decodes=False)
    return StepPhase(True, prefilled, end)


def max_block_causal_queries(block_length: int, seq_len: int, chunk: int) -> int:
    """The most queries any step of a block-causal request of `seq_len` positions can
    run: a whole-prefix step (after preemption, the prompt and every finished block),
    or a prefill chunk and the two blocks of a boundary step."""
    run = prefill_chunk_blocks(block_length, chunk) * block_length
    return min(seq_len, max(run, 2 * block_length)) if run else seq_len


def block_phase(
    options: DecodeOptions, block: int, block_step: int, prompt_len: int, has_cache: bool,
    prefilled: int = 0, chunk: int = 0,
) -> StepPhase:
    """The phase of step `block_step` of block `block` (`prefilled`, `chunk`: see
    block_causal_phase; other families always run their whole prefix)."""
    if is_block_causal(options):
        return block_causal_phase(options.block_length, prompt_len, block, block_step, has_cache, prefilled, chunk)
    seq_len = prompt_len + options.gen_length
    full = StepPhase(True, 0, seq_len)
    if options.cache == "none" or not has_cache:
        return full
    k = block_step
    delay, interval = options.delay_step, options.refresh_interval
    if k <= delay or (interval > 0 and (k - delay) % interval == 0):
        return full
    block_length = options.gen_length // options.num_blocks
    block_start = prompt_len + block * block_length
    if options.cache == "prefix":
        return StepPhase(False, block_start - query_lead(options), seq_len)
    span = options.vicinity if options.cache == "vicinity" else 0
    return StepPhase(False, max(block_start - query_lead(options) - span, 0),
                     min(block_start + block_length + span, seq_len))
