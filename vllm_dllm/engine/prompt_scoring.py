"""Prompt logprobs by the chain rule, for requests that ask (vLLM's prompt_logprobs).

log p(x_j | x_<j) is read from a copy of the prompt whose positions j and after are
all masked (Dream's left-to-right `ar_ftb` order; LLaDA the same with unshifted
logits): the prediction of position j there (row j, or row j - 1 for a model whose
logits are shifted).  Per-position values add up to log p(suffix | prefix) for any
split, which is what a client splitting context from continuation sums.  The P - 1
copies of a P-token prompt run in the request's first step, as one extra forward over
all scoring requests of the step whose copies attend only over their own K/V (no KV
pool is touched), so they cost P(P - 1) query tokens, priced by the scheduler.

A block-causal model (LLaDA2) predicts j from its block and the blocks before, as it
generates: j's copy ends with j's block, padded with masks past the prompt, and
attends block-causally, so it costs B ceil((j + 1) / B) tokens.

vLLM hands prompt logprobs to the client with a request's first output tokens; a
diffusion step may commit none, so the results wait here until the request's first
step that streams.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from vllm_dllm.attention.metadata import attention_metadata
from vllm_dllm.decoding.logprobs import candidate_logprobs
from vllm_dllm.engine.step_inputs import SequenceLayout, build_step_inputs, to_device

PromptLogprobs = tuple[np.ndarray, np.ndarray, np.ndarray]  # token ids [P-1, k+1], logprobs, ranks [P-1]


@dataclass(frozen=True)
class ScoringContext:
    """What the prompt scorers (prompt logprobs, the ELBO) read of the step engine:
    its prompts and canvases, its special ids and LM head, and what one forward over
    copies of prompts needs.  Made by the engine for each step that scores."""

    device: torch.device
    ids: object  # decoding/base.py SpecialIds: mask, eos
    logits_shift: bool  # the model predicts position j from row j - 1
    max_num_logits: int  # LM-head rows per chunk
    lm_head: object  # the engine's LMHead: project(hidden) -> logits, and its vocab
    host_prompt_len: np.ndarray  # per slot, on the host
    prompt_tokens: torch.Tensor  # [slots, positions]
    prompt_len: torch.Tensor  # [slots]
    canvas: torch.Tensor  # [slots, positions]
    block_table: torch.Tensor
    block_size: int
    backend: object  # the attention backend
    model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (input ids, positions) -> hidden states
    model_context: Callable[[int], object]  # the model's per-forward context, by token count


def block_end(position: np.ndarray, block_length: np.ndarray) -> np.ndarray:
    """The end of each position's block."""
    return (position // block_length + 1) * block_length


def scoring_tokens(prompt_len: np.ndarray, block_length: np.ndarray | int = 0) -> np.ndarray:
    """Query tokens of the masked copies of prompts of these lengths.  A copy is the
    whole prompt; a block-causal one (block_length > 0) ends with the block of the
    position it predicts, padded with masks: sum over j = 1..P-1 of B ceil((j+1)/B)."""
    prompt_len = np.asarray(prompt_len, dtype=np.int64)
    block = np.broadcast_to(np.asarray(block_length, dtype=np.int64), prompt_len.shape)
    full = prompt_len * np.maximum(prompt_len - 1, 0)
    b = np.maximum(block, 1)
    q, r = np.divmod(prompt_len, b)
    ceil_sum = b * q * (q + 1) // 2 + r * (q + 1)  # sum over m = 1..P of ceil(m / B)
    return np.where(block > 0, b * np.maximum(ceil_sum - 1, 0), full)


class PromptScorer:
    def __init__(self, capacity: int):
        self.num_logprobs = np.full(capacity, -1, dtype=np.int64)  # per slot; -1: nothing to score
        self.block_length = np.zeros(capacity, dtype=np.int64)  # per slot: block-causal blocks, 0: none
        self.pending: dict[str, PromptLogprobs] = {}

    def grow_slots(self, capacity: int) -> None:
        grown = np.full(capacity, -1, dtype=np.int64)
        grown[: len(self.num_logprobs)] = self.num_logprobs
        self.num_logprobs = grown
        blocks = np.zeros(capacity, dtype=np.int64)
        blocks[: len(self.block_length)] = self.block_length
        self.block_length = blocks

    def admit(self, slot: int, num_logprobs: int | None, block_length: int = 0) -> None:
        self.num_logprobs[slot] = -1 if num_logprobs is None else num_logprobs
        self.block_length[slot] = block_length

    def release(self, slot: int, req_id: str) -> None:
        self.num_logprobs[slot] = -1
        self.pending.pop(req_id, None)

    def asks(self, slots_host: np.ndarray) -> bool:
        """Whether a request of the step still waits for its prompt logprobs."""
        return bool((self.num_logprobs[slots_host] >= 0).any())

    def step_tokens(self, slots_host: np.ndarray, prompt_len: np.ndarray) -> np.ndarray:
        """Extra query tokens of each request in this step (its copies, in its first step)."""
        return np.where(self.num_logprobs[slots_host] >= 0,
                        scoring_tokens(prompt_len, self.block_length[slots_host]), 0)

    def score(self, ctx: ScoringContext, req_ids: list[str], slots_host: np.ndarray) -> None:
        """Run the copies of every request of the step that has not been scored yet."""
        todo = np.flatnonzero(self.num_logprobs[slots_host] >= 0)
        if not len(todo):
            return
        slots = slots_host[todo]
        k = int(self.num_logprobs[slots].max())
        lengths = ctx.host_prompt_len[slots]
        copies = np.maximum(lengths - 1, 0)
        results = self._run(ctx, slots, lengths, copies, k) if copies.sum() else None
        start = 0
        for index, slot, count in zip(todo.tolist(), slots.tolist(), copies.tolist()):
            width = int(self.num_logprobs[slot]) + 1
            if results is None:
                part = (np.zeros((0, width), np.int64), np.zeros((0, width), np.float32), np.zeros(0, np.int64))
            else:
                ids, values, ranks = results
                part = (ids[start : start + count, :width], values[start : start + count, :width],
                        ranks[start : start + count])
            self.pending[req_ids[index]] = part
            self.num_logprobs[slot] = -1
            start += count

    def take(self, req_id: str) -> PromptLogprobs | None:
        return self.pending.pop(req_id, None)

    @torch.inference_mode()
    def _run(self, ctx: ScoringContext, slots: np.ndarray, lengths: np.ndarray, copies: np.ndarray, k: int) -> PromptLogprobs:
        seq_slot = np.repeat(slots, copies)
        # Copy c of a prompt masks positions j = c + 1 onwards; a block-causal copy
        # ends with j's block (nothing after it reaches j).
        first = np.repeat(np.cumsum(copies) - copies, copies)
        masked_from = np.arange(len(seq_slot)) - first + 1
        blocks = self.block_length[seq_slot]
        seq_len = np.where(blocks > 0, block_end(masked_from, np.maximum(blocks, 1)), np.repeat(lengths, copies))
        row_masked_from = to_device(np.repeat(masked_from, seq_len), ctx.device)
        hidden, starts = forward_prompt_copies(
            ctx, seq_slot, lambda positions, ids: torch.where(positions >= row_masked_from, ctx.ids.mask, ids),
            seq_len=seq_len, block_length=blocks if blocks.any() else None)
        predicts = masked_from - 1 if ctx.logits_shift else masked_from
        rows = to_device(starts + predicts, ctx.device)
        targets = ctx.prompt_tokens[to_device(seq_slot, ctx.device), to_device(masked_from, ctx.device)]
        parts = []
        head = ctx.lm_head
        for start in range(0, len(rows), ctx.max_num_logits):
            chunk = slice(start, start + ctx.max_num_logits)
            parts.append(candidate_logprobs(head.project(hidden[rows[chunk]]), targets[chunk], k, head.vocab))
        ids = torch.cat([p.ids for p in parts]).cpu().numpy()
        values = torch.cat([p.values for p in parts]).cpu().numpy()
        ranks = torch.cat([p.rank for p in parts]).cpu().numpy()
        return ids, values, ranks


def forward_prompt_copies(
    ctx: ScoringContext, seq_slot: np.ndarray, tokens: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    seq_len: np.ndarray | None = None, block_length: np.ndarray | None = None,
) -> tuple[torch.Tensor, np.ndarray]:
    """One forward over copies of prompts: copy i is the first `seq_len[i]` positions
    (default: the whole prompt) of slot `seq_slot[i]`'s sequence, its tokens edited
    by `tokens(positions, input_ids)` (one per token of the copies, in order: which
    to mask, what to put past the prompt).  Each copy attends only over its own K/V
    (in flight: no KV pool is read or written), block-causally where `block_length`
    > 0.  Returns the hidden states and the first row of each copy."""
    if seq_len is None:
        seq_len = ctx.host_prompt_len[seq_slot]
    zeros = np.zeros(len(seq_slot), dtype=np.int64)
    layout = SequenceLayout(slot=seq_slot, twin=zeros.astype(bool), query_start=zeros, num_queries=seq_len,
                            seq_len=seq_len, kv_start=zeros)
    inputs = build_step_inputs(
        layout, prompt_tokens=ctx.prompt_tokens, prompt_len=ctx.prompt_len, canvas=ctx.canvas,
        block_table=ctx.block_table, block_size=ctx.block_size, mask_id=ctx.ids.mask, backend=ctx.backend,
    )
    input_ids = tokens(inputs.positions, inputs.input_ids)
    blocks = None if block_length is None else to_device(block_length, ctx.device)
    meta = dataclasses.replace(inputs.metadata, in_flight=True, in_flight_blocks=blocks)
    with attention_metadata(meta), ctx.model_context(len(input_ids)):
        hidden = ctx.model(input_ids, inputs.positions)
    return hidden, np.cumsum(seq_len) - seq_len
