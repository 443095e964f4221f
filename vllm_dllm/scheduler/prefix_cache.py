"""vLLM's automatic prefix caching for block-causal requests: which part of a hit
a request may take.

A block-causal model's K/V at a position depend on the tokens up to the end of that
position's diffusion block (a block attends to itself and to earlier blocks).  vLLM
hashes its KV blocks by the tokens up to each KV block's end and caches a request's
full prompt KV blocks when it admits it.  So a hit is exact only up to a boundary that
is a whole number of diffusion blocks (the tokens a K/V depends on are all inside the
hashed prefix) and of KV blocks (vLLM shares whole KV blocks), and inside the
prompt's whole diffusion blocks of the request that wrote them: the prompt's last,
partial diffusion block is denoised with the canvas, so its K/V depend on generated
tokens, and a finished request's last canvas block keeps K/V of a step that still had
masks.  Every KV block a request shares lies below that boundary, and a request
never writes below its own boundary (its first step starts there), so shared blocks
are never rewritten.
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
