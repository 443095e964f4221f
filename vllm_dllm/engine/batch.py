"""The batch of a step engine: request slots, their canvases and decoding state as
tensors, their phase parameters as host arrays, and the request lifecycle: admission,
KV blocks, preemption, removal and the grammars' decisions.  These are event-driven,
not per step: the step itself is engine.py.  Imports no vLLM."""

from __future__ import annotations

import numpy as np
import torch

from vllm_dllm.decoding.base import PAD, DecodeState, SpecialIds
from vllm_dllm.decoding.logits import LMHead
from vllm_dllm.decoding.rules import make_rule
from vllm_dllm.engine.batch_layout import SparseParams
from vllm_dllm.engine.batch_phases import PhaseParams
from vllm_dllm.engine.iter_smooth import SoftEmbeddings
from vllm_dllm.engine.constraints import FrontierMasks, GrammarStep, block_of, frontier_masks, return_to_mask
from vllm_dllm.engine.likelihood import ElboScorer, ElboTask
from vllm_dllm.engine.logprob_store import LogprobStore
from vllm_dllm.engine.prompt_scoring import PromptScorer
from vllm_dllm.engine.step_inputs import to_device
from vllm_dllm.options import CACHE_POLICIES, DecodeOptions, sequence_copies
from vllm_dllm.phases import is_block_causal, query_lead

# Stop tokens a request's slot holds (EOS and stop_token_ids): a call of several
# steps ends once every request in it has streamed one.  A request with more simply
# never ends a call early (its stops are still vLLM's to find).
STOP_SLOTS = 8

class RequestBatch:
    """Request slots and their state; slots double when a request finds none free."""

    def __init__(self, *, kind: str, ids: SpecialIds, capacity: int, max_model_len: int, block_size: int,
                 device: torch.device, lm_head: LMHead, prefill_chunk: int = 0, max_logprobs: int = 20,
                 embedding_rows=None):
        """`embedding_rows()`: the input embedding's rows for the LM head's columns
        (IterSmooth; None: a model without one, which refuses smoothing requests)."""
        self.ids = ids
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.prefill_chunk = prefill_chunk
        self.device = device
        self.lm_head = lm_head
        self.decode = DecodeState(capacity, max_model_len, ids, device, self.lm_head.vocab)
        self.rule = make_rule(kind, self.decode)
        max_blocks = -(-2 * max_model_len // block_size)  # a CFG twin doubles a request
        self.block_table = torch.zeros(capacity, max_blocks, dtype=torch.int32, device=device)
        self.prompt_tokens = torch.zeros(capacity, max_model_len, dtype=torch.long, device=device)
        self.prompt_len = torch.zeros(capacity, dtype=torch.long, device=device)
        # Host bookkeeping (numpy, as vLLM's input batch keeps it): never on the device.
        self.host = PhaseParams(
            prompt_len=np.zeros(capacity, dtype=np.int64),
            gen_length=np.zeros(capacity, dtype=np.int64),
            block=np.zeros(capacity, dtype=np.int64),
            block_step=np.zeros(capacity, dtype=np.int64),
            has_cache=np.zeros(capacity, dtype=bool),
            policy=np.zeros(capacity, dtype=np.int64),
            block_length=np.ones(capacity, dtype=np.int64),
            lead=np.zeros(capacity, dtype=np.int64),
            vicinity=np.zeros(capacity, dtype=np.int64),
            delay_step=np.zeros(capacity, dtype=np.int64),
            refresh_interval=np.zeros(capacity, dtype=np.int64),
            segment=np.zeros(capacity, dtype=np.int64),
            prefilled=np.zeros(capacity, dtype=np.int64),
            chunk=np.zeros(capacity, dtype=np.int64),
        )
        self.copies = np.ones(capacity, dtype=np.int64)
        self.evicted = np.zeros(capacity, dtype=bool)  # its cache was freed by preemption
        self.snapshot = torch.zeros_like(self.decode.canvas)  # canvas of each request's last Refresh
        self.stop_ids = torch.full((capacity, STOP_SLOTS), -1, dtype=torch.long, device=device)
        self.logprobs = LogprobStore(capacity, max_model_len, max_logprobs, device)
        self.prompt_scorer = PromptScorer(capacity)
        self.elbo_scorer = ElboScorer()
        self.smooth = SoftEmbeddings(capacity, device, lm_head.vocab, embedding_rows)
        self.sparse = SparseParams(
            sequence_slots=np.zeros(capacity, dtype=np.int64),
            keep=np.zeros(capacity, dtype=np.int64),
            radius=np.zeros(capacity, dtype=np.int64),
            uniform=np.zeros(capacity, dtype=bool),
            mean_scoring=np.zeros(capacity, dtype=bool),
            weight_scoring=np.zeros(capacity, dtype=bool),
        )
        self.slots: dict[str, int] = {}
        self.emitted: dict[str, int] = {}
        self._masks: FrontierMasks | None = None  # this step's grammar masks (constrain)
        self._num_blocks: dict[str, int] = {}
        self._free = list(range(capacity - 1, -1, -1))

    @property
    def capacity(self) -> int:
        return self.decode.capacity

    def add(
        self, req_id: str, prompt: list[int], options: DecodeOptions, seed: int, block_ids: list[int],
        prefilled: int = 0, logprobs: int | None = None, prompt_logprobs: int | None = None,
        likelihood: ElboTask | None = None, stop_ids: tuple[int, ...] = (),
    ) -> None:
        """A new request; `prefilled`: leading positions whose K/V its blocks already
        hold (a block-causal request's prefix cache hit); `logprobs`: top entries per
        token it wants logprobs with (None: no logprobs); `prompt_logprobs`: the same
        for its prompt's tokens (scored in its first step); `likelihood`: the ELBO of its
        prompt's continuation to estimate in its first step; `stop_ids`: the tokens
        that finish it (vLLM's EOS and stop_token_ids)."""
        if req_id in self.slots:
            raise ValueError(f"request {req_id} is already in the batch")
        if not prompt:
            raise ValueError(f"request {req_id}: an empty prompt (a canvas needs at least one token before it)")
        if not self._free:
            self._grow()
        options = options.placed(len(prompt))
        if len(prompt) + options.gen_length > self.max_model_len:
            raise ValueError(
                f"request {req_id}: prompt {len(prompt)} + canvas {options.gen_length} tokens exceed "
                f"the model length {self.max_model_len}"
            )
        self._check_prefilled(req_id, prefilled, options, len(prompt))
        for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if value is not None and not 0 <= value < self.logprobs.width:
                raise ValueError(f"request {req_id}: {name} must be between 0 and {self.logprobs.width - 1}")
        if likelihood is not None and (is_block_causal(options) or likelihood.request.context_tokens >= len(prompt)):
            raise ValueError(f"request {req_id}: no ELBO of its prompt: block-causal, or no continuation to score")
        self.smooth.make_room(options)
        slot = self._free.pop()
        self.slots[req_id] = slot
        self.emitted[req_id] = 0
        self.prompt_tokens[slot, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        self.prompt_len[slot] = len(prompt)
        self.decode.admit(slot, options, seed)
        self.stop_ids[slot] = -1
        if len(stop_ids) <= STOP_SLOTS:
            self.stop_ids[slot, : len(stop_ids)] = torch.tensor(list(stop_ids), dtype=torch.long)
        self.rule.admit(slot, options)
        self.logprobs.admit(slot, logprobs)
        self.prompt_scorer.admit(slot, prompt_logprobs, options.block_length if is_block_causal(options) else 0)
        self.elbo_scorer.admit(slot, likelihood)
        self.smooth.admit(slot, options)
        h = self.host
        h.prompt_len[slot] = len(prompt)
        h.gen_length[slot] = options.gen_length
        h.block[slot] = 0
        h.block_step[slot] = 0
        h.has_cache[slot] = False
        self.evicted[slot] = False
        self.copies[slot] = sequence_copies(options)
        h.policy[slot] = CACHE_POLICIES.index(options.cache)
        h.block_length[slot] = options.gen_length // options.num_blocks
        h.delay_step[slot] = options.delay_step
        h.refresh_interval[slot] = options.refresh_interval
        h.lead[slot] = query_lead(options)
        # A span past the sequence runs what the sequence's length does (phases clip it).
        vicinity = options.vicinity if getattr(options, "cache", None) == "vicinity" else 0
        h.vicinity[slot] = min(vicinity, self.max_model_len)
        causal = is_block_causal(options)
        h.segment[slot] = options.block_length if causal else 0
        h.chunk[slot] = self.prefill_chunk if causal else 0
        h.prefilled[slot] = prefilled
        self.sparse.admit(slot, options, len(prompt))
        self.set_blocks(req_id, block_ids)

    def _grow(self) -> None:
        """Double the slots (preempted requests keep theirs while others run)."""
        old = self.capacity
        for holder in (self, self.decode, *self.rule.slot_holders(), self.host, self.sparse):
            for name, value in vars(holder).items():
                if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == old:
                    grown = value.new_zeros((2 * old, *value.shape[1:]))
                elif isinstance(value, np.ndarray) and value.shape[0] == old:
                    grown = np.zeros((2 * old, *value.shape[1:]), dtype=value.dtype)
                else:
                    continue
                grown[:old] = value
                setattr(holder, name, grown)
        self.logprobs.grow_slots(2 * old)
        self.prompt_scorer.grow_slots(2 * old)
        self.smooth.grow_slots(2 * old)
        self._free.extend(range(2 * old - 1, old - 1, -1))

    @staticmethod
    def _check_prefilled(req_id: str, prefilled: int, options: DecodeOptions, prompt_len: int) -> None:
        whole = prompt_len - prompt_len % options.block_length if is_block_causal(options) else 0
        if prefilled and (prefilled > whole or prefilled % options.block_length):
            raise ValueError(
                f"request {req_id}: {prefilled} cached positions are not whole blocks of its prompt's {whole}"
            )

    def resume(self, req_id: str, block_ids: list[int], prefilled: int = 0) -> None:
        """A preempted request back with new KV blocks, `prefilled` of them from the
        prefix cache (block-causal; otherwise 0)."""
        slot = self.slots[req_id]
        if prefilled and self.host.segment[slot] == 0:
            raise ValueError(f"request {req_id}: only a block-causal request resumes from cached K/V")
        if prefilled and prefilled % self.host.segment[slot]:
            raise ValueError(f"request {req_id}: {prefilled} cached positions are not whole blocks")
        self.set_blocks(req_id, block_ids)
        self.host.prefilled[slot] = prefilled

    def set_blocks(self, req_id: str, block_ids: list[int]) -> None:
        """The request's KV blocks, in order (a resumed request gets new ones)."""
        slot = self.slots[req_id]
        if len(block_ids) > self.block_table.shape[1]:
            raise ValueError(f"request {req_id}: {len(block_ids)} KV blocks, at most {self.block_table.shape[1]}")
        self.block_table[slot, : len(block_ids)] = torch.tensor(block_ids, dtype=torch.int32)
        self._num_blocks[req_id] = len(block_ids)

    def append_blocks(self, req_id: str, block_ids: list[int]) -> None:
        slot, start = self.slots[req_id], self._num_blocks[req_id]
        self.block_table[slot, start : start + len(block_ids)] = torch.tensor(block_ids, dtype=torch.int32)
        self._num_blocks[req_id] = start + len(block_ids)

    def drop_cache(self, req_id: str) -> None:
        """Its KV blocks were freed (preemption): the step after resuming refreshes, or
        rebuilds the cache from the last Refresh's canvas before a Reuse (phases.py)."""
        slot = self.slots[req_id]
        # A block-causal request recomputes its prefix from its tokens instead.
        self.evicted[slot] |= self.host.has_cache[slot] & (self.host.segment[slot] == 0)
        self.host.has_cache[slot] = False
        self.host.prefilled[slot] = 0

    def remove(self, req_id: str) -> None:
        slot = self.slots.pop(req_id, None)
        if slot is not None:
            self.logprobs.release(slot)
            self.prompt_scorer.release(slot, req_id)
            self.elbo_scorer.release(slot)
            self.smooth.release(slot)
            self.emitted.pop(req_id)
            self._num_blocks.pop(req_id, None)
            self._free.append(slot)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.slots

    def constrain(self, step: GrammarStep | None) -> None:
        """The grammars' decisions for the coming step: tokens that broke a grammar go
        back to the mask (their request restarts the block holding the first), forced
        tokens are committed at the frontiers, and the frontier masks wait for the
        LM head.  Requests this engine does not hold (finished meanwhile) are skipped."""
        self._masks = None
        if not step:
            return
        returned = {r: p for r, p in step.returned.items() if r in self.slots}
        if returned:
            slots_host = np.array([self.slots[r] for r in returned], dtype=np.int64)
            starts = np.array(list(returned.values()), dtype=np.int64)
            slots = to_device(slots_host, self.device)
            return_to_mask(self.decode.canvas, slots, to_device(starts, self.device), self.ids.mask, PAD)
            blocks = block_of(starts, self.host.prompt_len[slots_host], self.host.block_length[slots_host],
                              self.host.segment[slots_host])
            self.host.block[slots_host], self.host.block_step[slots_host] = blocks, 0
            self.decode.block[slots], self.decode.block_step[slots] = to_device(blocks, self.device), 0
            self.rule.restart_block(slots, to_device(starts, self.device))
            self.smooth.forget(slots, to_device(starts, self.device))
            self.emitted.update(returned)
        forced = {r: t for r, t in step.forced.items() if r in self.slots and t}
        if forced:
            slots_host = np.concatenate([np.full(len(t), self.slots[r], dtype=np.int64) for r, t in forced.items()])
            positions = np.concatenate([self.emitted[r] + np.arange(len(t)) for r, t in forced.items()])
            tokens = np.concatenate([np.asarray(t, dtype=np.int64) for t in forced.values()])
            self.decode.canvas[to_device(slots_host, self.device), to_device(positions, self.device)] = to_device(
                tokens, self.device)
            self.logprobs.record_forced(slots_host, positions, tokens)
        frontier = {r: self.emitted[r] + len(step.forced.get(r, ())) for r in step.masked if r in self.slots}
        self._masks = frontier_masks(step, self.slots, frontier, self.capacity, self.device)
