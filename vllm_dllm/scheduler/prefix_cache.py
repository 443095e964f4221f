"""vLLM's automatic prefix caching for block-causal requests: which part of a hit
a request may take.

A block-causal model's K/V at a position depend on the tokens up to the end of that
position's diffusion block (a block attends to itself and to earlier blocks).  vLLM
hashes its KV blocks by the tokens up to each KV block's end.  The scheduler hands
vLLM a request's KV blocks only once their K/V are final (RequestTrack.exact_prefix:
the prompt's whole diffusion blocks, then each canvas block once the next one has run
a step, which rewrote it from its final tokens), so a cached block holds the K/V of
its hashed tokens, and a multi-turn chat's next prompt finds its earlier answers too.
A hit is exact only up to a boundary that is a whole number of diffusion blocks (the
tokens a K/V depends on are all inside the hashed prefix) and of KV blocks (vLLM
shares whole KV blocks), inside the new prompt's whole diffusion blocks (its partial
last block is denoised with its canvas).  Every KV block a request shares lies below
that boundary, and a request never writes below its own boundary (its first step
starts there), so shared blocks are never rewritten.
"""

from __future__ import annotations

import math

from vllm.v1.core.kv_cache_manager import KVCacheBlocks


def usable_prefix(hit_tokens: int, prompt_len: int, block_length: int, kv_block_size: int) -> int:
    """Leading positions of a hit of `hit_tokens` whose cached K/V are exactly what
    this request's own prefill would write."""
    unit = math.lcm(block_length, kv_block_size)
    whole_prompt_blocks = prompt_len - prompt_len % block_length
    return min(hit_tokens, whole_prompt_blocks) // unit * unit


def leading_blocks(blocks: KVCacheBlocks, num_tokens: int, kv_block_size: int) -> KVCacheBlocks:
    """The first `num_tokens` (whole KV blocks) of a hit, in every KV cache group."""
    count = num_tokens // kv_block_size
    return KVCacheBlocks(tuple(list(group[:count]) for group in blocks.blocks))
