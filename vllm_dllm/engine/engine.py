"""The step engine: a persistent batch of diffusion requests and one denoising step
for any subset of them.  Imports no vLLM.

Data path of a step: phases of the scheduled requests (host arrays) -> packed step
inputs (engine/step_inputs.py) -> model forward (one attention call per layer for
the whole batch) -> the rule plans candidates -> the hidden rows of every request's
candidates go through the LM head together, in chunks -> the rule commits for all
requests -> newly final tokens come back in one host copy.  Nothing in that path
loops over requests in Python; host<->device syncs per step: the candidate count
(to size the LM-head work) and the final copy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from vllm_dllm.attention.metadata import attention_metadata
from vllm_dllm.decoding.base import PAD, DecodeState, SpecialIds
from vllm_dllm.decoding.rules import make_rule
from vllm_dllm.decoding.logits import LMHead, chunked_reduce
from vllm_dllm.decoding.logprobs import LogprobsCollector
from vllm_dllm.engine.constraints import FrontierMasks, GrammarStep, block_of, frontier_masks, return_to_mask
from vllm_dllm.engine.graphs import ReuseGraphs
from vllm_dllm.engine.likelihood import ElboScorer, ElboTask
from vllm_dllm.engine.logprob_store import LogprobStore
from vllm_dllm.engine.prompt_scoring import PromptLogprobs, PromptScorer, ScoringContext
from vllm_dllm.engine.batch_phases import POLICY_NONE, POLICY_SPARSE, PhaseParams, batch_phases
from vllm_dllm.engine.step_inputs import SequenceLayout, FillLayout, build_step_inputs, to_device
from vllm_dllm.kv_footprint import kept_positions, sequence_slots
from vllm_dllm.options import CACHE_POLICIES, DecodeOptions, sequence_copies
from vllm_dllm.phases import is_block_causal, query_lead

logger = logging.getLogger(__name__)

ModelContext = Callable[[int], contextlib.AbstractContextManager]


def _no_context(num_tokens: int) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


@dataclass
class BatchLayout:
    # The scheduled requests in order, then their CFG twins; cache fills last.
    sequences: SequenceLayout
    fill: FillLayout | None  # the cache-filling sequences, if any
    refresh: np.ndarray  # bool per request: this step is a Refresh
    rebuild: np.ndarray  # bool per request: its evicted cache is rebuilt before its Reuse
    decodes: np.ndarray  # bool per request: False for a block-causal prefill chunk (K/V only)
    query_end: np.ndarray  # per request: one past its last query position
    tokens: np.ndarray  # query tokens per request (both copies under CFG)
    request_seq: np.ndarray  # sequence index of each request
    twin_seq: np.ndarray  # sequence index of each request's twin (its own without CFG)
    has_twins: bool  # some request runs a CFG twin


@dataclass
class SparseParams:
    """Per-slot sparse KV numbers (host): see kv_footprint.py and attention/sparse.py."""

    sequence_slots: np.ndarray  # KV slots of one sequence (dense: its length)
    keep: np.ndarray  # positions each KV head keeps (0 unless sparse)
    radius: np.ndarray
    uniform: np.ndarray
    mean_scoring: np.ndarray


@dataclass
class StepOutput:
    new_tokens: list[list[int]]  # per scheduled request, in order
    logits_rows: int  # LM-head rows this step computed
    progress: list[tuple[int, int]]  # per scheduled request: (block, step in block) of its next step
    edits: int = 0  # committed tokens the step rewrote (token editing)
    # For the requests that asked for logprobs, a row per new token, in request
    # order: (token ids [T, k + 1], logprobs [T, k + 1], ranks [T]) and each
    # request's first row (requests that did not ask take no rows).
    logprobs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    logprobs_start: list[int] | None = None
    # Prompt logprobs of requests streaming their first tokens (engine/prompt_scoring.py).
    prompt_logprobs: dict[str, PromptLogprobs] = dataclasses.field(default_factory=dict)
    # ELBO estimates of requests scored this step (engine/likelihood.py).
    likelihoods: dict[str, dict] = dataclasses.field(default_factory=dict)


_CANVAS = 5  # the report's first canvas column (after final, candidates, block, block step, edits)


class StepEngine:
    """Request slots, their canvases and parameters as tensors, and the step.

    `model(input_ids, positions)` returns hidden states and reads attention metadata
    from the context; `model.compute_logits(hidden_rows)` projects rows to the
    vocabulary (or `lm_head` to this rank's shard of it); `model.logits_shift`
    says whether token j is predicted from the hidden state at j - 1 (Dream) or at
    j (LLaDA).
    """

    def __init__(
        self,
        model,
        *,
        kind: str,
        ids: SpecialIds,
        capacity: int,
        max_model_len: int,
        block_size: int,
        max_num_logits: int,
        backend,
        device: torch.device,
        cuda_graphs: bool = False,
        max_graph_seqs: int = 64,
        graph_capture=None,
        model_context: ModelContext | None = None,
        prefill_chunk: int = 0,
        max_logprobs: int = 20,
        lm_head: LMHead | None = None,
    ):
        """`cuda_graphs`: replay captured forwards for Reuse steps (engine/graphs.py)
        where the device and backend allow it; `graph_capture` replaces the plain
        CUDA capture: a capture inside vLLM's graph_capture under tensor parallelism,
        or a stand-in that tests use on a CPU.  `model_context(num_tokens)` is entered
        around every forward: vLLM's forward context when serving (its fused MoE
        layers look themselves up there), nothing otherwise.  `prefill_chunk`: the
        most tokens a block-causal prefill step runs (phases.block_causal_phase), 0:
        the whole prefix in one step.  `max_logprobs`: the most top logprobs a
        request may ask for per token (vLLM's --max-logprobs).  `lm_head`: logits
        rows of a vocabulary shard and its `VocabShard` (tensor parallelism); by
        default the model's whole-vocabulary `compute_logits`."""
        self.model = model
        self.model_context = model_context or _no_context
        self.ids = ids
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_logits = max_num_logits
        self.prefill_chunk = prefill_chunk
        self.backend = backend
        self.device = device
        self.logits_shift = bool(getattr(model, "logits_shift", False))
        self.lm_head = lm_head or LMHead(model.compute_logits)
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
            delay_step=np.zeros(capacity, dtype=np.int64),
            refresh_interval=np.zeros(capacity, dtype=np.int64),
            segment=np.zeros(capacity, dtype=np.int64),
            prefilled=np.zeros(capacity, dtype=np.int64),
            chunk=np.zeros(capacity, dtype=np.int64),
        )
        self.copies = np.ones(capacity, dtype=np.int64)
        self.evicted = np.zeros(capacity, dtype=bool)  # its cache was freed by preemption
        self.snapshot = torch.zeros_like(self.decode.canvas)  # canvas of each request's last Refresh
        self.logprobs = LogprobStore(capacity, max_model_len, max_logprobs, device)
        self.prompt_scorer = PromptScorer(capacity)
        self.elbo_scorer = ElboScorer()
        self.sparse = SparseParams(
            sequence_slots=np.zeros(capacity, dtype=np.int64),
            keep=np.zeros(capacity, dtype=np.int64),
            radius=np.zeros(capacity, dtype=np.int64),
            uniform=np.zeros(capacity, dtype=bool),
            mean_scoring=np.zeros(capacity, dtype=bool),
        )
        self.slots: dict[str, int] = {}
        self.emitted: dict[str, int] = {}
        self._masks: FrontierMasks | None = None  # this step's grammar masks (constrain)
        self._num_blocks: dict[str, int] = {}
        self._free = list(range(capacity - 1, -1, -1))
        self.graphs = None
        if cuda_graphs and (device.type == "cuda" or graph_capture is not None):
            if getattr(backend, "graph_safe", False):
                self.graphs = ReuseGraphs(
                    model, backend, device=device, block_size=block_size, max_blocks=max_blocks,
                    max_seqs=max_graph_seqs, capture=graph_capture, model_context=self.model_context,
                )
            else:
                logger.info("CUDA graphs off: attention backend %r cannot be captured", backend.name)

    # ---- request lifecycle (event-driven, not per step) ---------------------

    @property
    def capacity(self) -> int:
        return self.decode.capacity

    def add(
        self, req_id: str, prompt: list[int], options: DecodeOptions, seed: int, block_ids: list[int],
        prefilled: int = 0, logprobs: int | None = None, prompt_logprobs: int | None = None,
        likelihood: ElboTask | None = None,
    ) -> None:
        """A new request; `prefilled`: leading positions whose K/V its blocks already
        hold (a block-causal request's prefix cache hit); `logprobs`: top entries per
        token it wants logprobs with (None: no logprobs); `prompt_logprobs`: the same
        for its prompt's tokens (scored in its first step); `likelihood`: the ELBO of its
        prompt's continuation to estimate in its first step."""
        if req_id in self.slots:
            raise ValueError(f"request {req_id} is already in the batch")
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
        slot = self._free.pop()
        self.slots[req_id] = slot
        self.emitted[req_id] = 0
        self.prompt_tokens[slot, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        self.prompt_len[slot] = len(prompt)
        self.decode.admit(slot, options, seed)
        self.rule.admit(slot, options)
        self.logprobs.admit(slot, logprobs)
        self.prompt_scorer.admit(slot, prompt_logprobs, options.block_length if is_block_causal(options) else 0)
        self.elbo_scorer.admit(slot, likelihood)
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
        causal = is_block_causal(options)
        h.segment[slot] = options.block_length if causal else 0
        h.chunk[slot] = self.prefill_chunk if causal else 0
        h.prefilled[slot] = prefilled
        sp = self.sparse
        sp.sequence_slots[slot] = sequence_slots(options, len(prompt))
        sp.keep[slot] = kept_positions(options, len(prompt))
        sp.radius[slot] = options.pool_kernel // 2
        sp.uniform[slot] = options.selection == "uniform"
        sp.mean_scoring[slot] = options.scoring == "mean"
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
            self.emitted.pop(req_id)
            self._num_blocks.pop(req_id, None)
            self._free.append(slot)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.slots

    # ---- structured outputs (engine/constraints.py) ---------------------------

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

    # ---- one step ------------------------------------------------------------

    def layout(self, slots: np.ndarray) -> BatchLayout:
        """Sequences of this step: the requests, their CFG twins, then the
        cache-filling ones (sparse Refreshes, rebuilds of evicted caches), with each
        request's phase."""
        h, sp = self.host, self.sparse
        params = {name: getattr(h, name)[slots] for name in PhaseParams.__dataclass_fields__}
        evicted = self.evicted[slots]
        params["has_cache"] = params["has_cache"] | evicted  # rebuilt within the step
        phases = batch_phases(PhaseParams(**params))
        rebuilds = evicted & ~phases.refresh
        copies = self.copies[slots]
        requests = len(slots)
        twins = np.flatnonzero(copies == 2)
        rebuilt = np.flatnonzero(rebuilds)
        rebuilt = np.concatenate([rebuilt, rebuilt[copies[rebuilt] == 2]])
        own = requests + len(twins)
        request_of = np.concatenate([np.arange(requests), twins, rebuilt])  # per sequence
        twin = np.zeros(len(request_of), dtype=bool)
        twin[requests:own] = True
        twin[own + int(rebuilds.sum()):] = True
        rebuild = np.arange(len(request_of)) >= own
        is_sparse = h.policy[slots] == POLICY_SPARSE
        fills = rebuild | (phases.refresh & is_sparse)[request_of]
        order = np.argsort(fills, kind="stable")  # cache fills last
        request_of, twin, rebuild, fills = request_of[order], twin[order], rebuild[order], fills[order]
        position = np.empty_like(order)
        position[order] = np.arange(len(order))
        request_seq = position[:requests]
        twin_seq = request_seq.copy()
        twin_seq[twins] = position[requests:own]

        seq_len = h.prompt_len[slots] + h.gen_length[slots]
        keep = sp.keep[slots]
        sparse_reuse = is_sparse & ~phases.refresh
        r = request_of
        layout = SequenceLayout(
            slot=slots[r],
            twin=twin,
            query_start=np.where(rebuild, 0, phases.query_start[r]),
            num_queries=np.where(rebuild, seq_len[r], phases.num_queries[r]),
            seq_len=np.where(rebuild, seq_len[r], np.where(sparse_reuse, keep + phases.num_queries, seq_len)[r]),
            kv_start=np.where(twin, sp.sequence_slots[slots][r], 0),
            slot_start=np.where(rebuild, 0, np.where(sparse_reuse, keep, phases.query_start)[r]),
            rebuild=rebuild,
        )
        fill = None
        if fills.any():
            f = r[fills]
            span = phases.reuse_end[f] - phases.reuse_start[f]
            fill = FillLayout(
                reuse_start=phases.reuse_start[f], reuse_end=phases.reuse_end[f],
                keep=np.where(is_sparse[f], keep[f], seq_len[f] - span),
                radius=sp.radius[slots][f], uniform=sp.uniform[slots][f],
                mean_scoring=sp.mean_scoring[slots][f], dense=~is_sparse[f],
            )
        tokens = (phases.num_queries + rebuilds * seq_len) * copies
        layout, last_piece = layout.split_blocks(phases.segment[r] * ~twin)
        request_seq, twin_seq = last_piece[request_seq], last_piece[twin_seq]
        return BatchLayout(layout, fill, phases.refresh, rebuilds, phases.decodes, phases.query_end, tokens,
                           request_seq, twin_seq, len(twins) > 0)

    @torch.inference_mode()
    def step(self, req_ids: list[str], planned_tokens: list[int] | None = None) -> StepOutput:
        """One denoising step of the requests `req_ids`.

        `planned_tokens`, when given, is what the scheduler priced each request's
        step at; a mismatch means scheduler and engine disagree on the phase.
        """
        slots_host = np.array([self.slots[r] for r in req_ids], dtype=np.int64)
        batch = self.layout(slots_host)
        prompt_len = self.host.prompt_len[slots_host]
        tokens = (batch.tokens + self.prompt_scorer.step_tokens(slots_host, prompt_len)
                  + self.elbo_scorer.step_tokens(slots_host, prompt_len))
        if planned_tokens is not None:
            planned = np.array(planned_tokens, dtype=np.int64)
            if not np.array_equal(planned, tokens):
                bad = np.flatnonzero(planned != tokens).tolist()
                raise RuntimeError(
                    "scheduler and engine disagree on query tokens: "
                    + ", ".join(f"{req_ids[i]} planned {planned_tokens[i]}, step has {int(tokens[i])}" for i in bad)
                )
        inputs = build_step_inputs(
            batch.sequences,
            prompt_tokens=self.prompt_tokens,
            prompt_len=self.prompt_len,
            canvas=self.decode.canvas,
            block_table=self.block_table,
            block_size=self.block_size,
            mask_id=self.ids.mask,
            backend=self.backend,
            fill=batch.fill,
            snapshot=self.snapshot,
        )
        self._keep_snapshots(slots_host, batch)
        hidden = self._forward(batch, inputs)

        h = self.host
        chunked = ~batch.decodes
        h.prefilled[slots_host] = np.where(chunked, batch.query_end, h.prefilled[slots_host])
        h.has_cache[slots_host] |= (batch.refresh & batch.decodes) | batch.rebuild
        self.evicted[slots_host] = False
        # A prefill chunk only wrote K/V: its request is not denoised this step.
        decoding = np.flatnonzero(batch.decodes) if chunked.any() else np.arange(len(req_ids))
        new_tokens: list[list[int]] = [[] for _ in req_ids]
        starts = np.zeros(len(req_ids), dtype=np.int64)
        logits_rows = edits = 0
        if len(decoding):
            report = self._denoise(slots_host[decoding], batch.request_seq[decoding], batch.twin_seq[decoding],
                                   batch.has_twins, hidden, inputs)
            progress = report[:, 2:4].numpy()
            h.block[slots_host[decoding]], h.block_step[slots_host[decoding]] = progress[:, 0], progress[:, 1]
            copies = self.copies[slots_host[decoding]].tolist()
            for index, row, n in zip(decoding.tolist(), report.tolist(), copies):
                req_id = req_ids[index]
                start, end = self.emitted[req_id], row[0]
                new_tokens[index] = row[_CANVAS + start : _CANVAS + end]
                starts[index] = start
                self.emitted[req_id] = end
                logits_rows += row[1] * n
                edits += row[4]
        progress = np.stack([h.block[slots_host], h.block_step[slots_host]], axis=1)
        output = StepOutput(new_tokens=new_tokens, logits_rows=logits_rows,
                            progress=[tuple(p) for p in progress.tolist()], edits=edits)
        self._masks = None
        self._take_logprobs(slots_host, starts, output)
        if self.prompt_scorer.asks(slots_host) or self.elbo_scorer.tasks:
            context = self._scoring_context()
            self.prompt_scorer.score(context, req_ids, slots_host)
            output.likelihoods = self.elbo_scorer.score(context, req_ids, slots_host)
        if self.prompt_scorer.pending:
            for req_id, new in zip(req_ids, new_tokens):
                if new and req_id in self.prompt_scorer.pending:
                    output.prompt_logprobs[req_id] = self.prompt_scorer.take(req_id)
        return output

    def _scoring_context(self) -> ScoringContext:
        return ScoringContext(
            device=self.device, ids=self.ids, logits_shift=self.logits_shift, max_num_logits=self.max_num_logits,
            lm_head=self.lm_head, host_prompt_len=self.host.prompt_len, prompt_tokens=self.prompt_tokens,
            prompt_len=self.prompt_len, canvas=self.decode.canvas, block_table=self.block_table,
            block_size=self.block_size, backend=self.backend, model=self.model, model_context=self.model_context,
        )

    def _take_logprobs(self, slots_host: np.ndarray, starts: np.ndarray, output: StepOutput) -> None:
        """The logprob rows of the new tokens of the requests that asked (the step's
        third device-to-host copy, only when one of them has new tokens)."""
        if not self.logprobs.row_of[slots_host].any():
            return
        counts = np.array([len(t) for t in output.new_tokens], dtype=np.int64)
        asking = (self.logprobs.row_of[slots_host] > 0) & (counts > 0)
        if not asking.any():
            return
        output.logprobs = self.logprobs.take(slots_host[asking], starts[asking], starts[asking] + counts[asking])
        output.logprobs_start = np.concatenate([[0], np.cumsum(np.where(asking, counts, 0))[:-1]]).tolist()

    def _denoise(self, slots_host, request_seq, twin_seq, has_twins, hidden, inputs) -> torch.Tensor:
        """The rule's step for the requests in `slots_host` (their sequences' rows of
        `hidden`), and its report: per request the count of final tokens, its
        candidates, its (block, step in block), its edits, then its canvas."""
        width = int(self.host.gen_length[slots_host].max())
        slots = to_device(slots_host, self.device)
        seqs = to_device(np.stack([request_seq, twin_seq]), self.device)
        logprobs_k = self.logprobs.step_width(slots_host)
        collector = (LogprobsCollector(logprobs_k, self.device, self.lm_head.vocab)
                     if logprobs_k is not None else None)
        before = self.decode.canvas[slots, :width].clone() if collector is not None else None
        done = self.rule.denoise(
            slots_host, slots, width,
            lambda rows, positions: self._reduce(hidden, inputs, seqs, has_twins, slots, rows, positions, collector),
        )
        decode = self.decode
        if collector is not None:
            # Every position whose token this step wrote (a commit or an edit) keeps
            # the logprob row of this step.
            written = decode.canvas[slots[done.rows], done.positions] != before[done.rows, done.positions]
            self.logprobs.record(slots_host, done.rows, done.positions, written, collector.result())
        final = self.rule.num_final(slots, width)
        return torch.cat(
            [final[:, None], done.plan.candidates.sum(dim=1)[:, None], decode.block[slots, None],
             decode.block_step[slots, None], self.rule.edits(slots)[:, None], decode.canvas[slots, :width]], dim=1,
        ).to("cpu")  # the step's second sync: everything the host needs, in one copy

    def _keep_snapshots(self, slots_host: np.ndarray, batch: BatchLayout) -> None:
        """The canvas a cached request's Refresh runs on: what its cache holds until
        the next Refresh, kept to rebuild it should preemption free its blocks."""
        filled = slots_host[batch.refresh & (self.host.policy[slots_host] != POLICY_NONE)]
        if len(filled):
            index = to_device(filled, self.device)
            self.snapshot[index] = self.decode.canvas[index]

    def _forward(self, batch: BatchLayout, inputs) -> torch.Tensor:
        key = None
        if self.graphs is not None and batch.fill is None:
            key = self.graphs.key(batch.sequences.num_queries, batch.refresh, inputs.metadata.has_kv_offset)
        if key is None:
            with attention_metadata(inputs.metadata), self.model_context(len(inputs.input_ids)):
                return self.model(inputs.input_ids, inputs.positions)
        return self.graphs.forward(key, inputs.input_ids, inputs.positions, inputs.metadata)

    def _reduce(self, hidden, inputs, seqs, has_twins: bool, slots, rows, positions, logprobs=None):
        """(token, confidence) of each candidate: its hidden row (the row of the
        position before it for a shifted model; the twin's row too under CFG) through
        the LM head in chunks, reduced by the rule."""
        cand_slots = slots[rows]
        source = self.prompt_len[cand_slots] + positions
        if self.logits_shift:
            source = (source - 1).clamp(min=0)
        seqs = seqs[:, rows]
        offset = source - inputs.query_start[seqs[0]]
        uncond_rows = cfg_scale = grammar = None
        if self._masks is not None:
            grammar = (self._masks.bitmask, self._masks.rows_for(cand_slots, positions))
        if has_twins:
            uncond_rows = inputs.query_start_loc[seqs[1]] + offset
            cfg_scale = self.decode.cfg_scale[cand_slots]
        return chunked_reduce(
            hidden,
            inputs.query_start_loc[seqs[0]] + offset,
            cand_slots,
            positions,
            self.lm_head.project,
            self.rule,
            self.max_num_logits,
            uncond_rows=uncond_rows,
            cfg_scale=cfg_scale,
            logprobs=logprobs,
            grammar=grammar,
        )

    # ---- memory profiling ----------------------------------------------------

    @torch.inference_mode()
    def profile_step(self, max_num_tokens: int) -> None:
        """A dummy step at the configured caps, so memory profiling sees the peak:
        full-length Refresh sequences filling the token budget, then the LM head
        and the costliest reduction over `max_num_logits` rows."""
        lengths = []
        remaining = max_num_tokens
        while remaining > 0:
            lengths.append(min(remaining, self.max_model_len))
            remaining -= lengths[-1]
        count = len(lengths)
        seq_len = np.array(lengths, dtype=np.int64)
        zeros = np.zeros(count, dtype=np.int64)
        layout = SequenceLayout(
            slot=zeros, twin=zeros.astype(bool), query_start=zeros, num_queries=seq_len, seq_len=seq_len, kv_start=zeros
        )
        inputs = build_step_inputs(
            layout,
            prompt_tokens=self.prompt_tokens,
            prompt_len=self.prompt_len,
            canvas=self.decode.canvas,
            block_table=torch.zeros_like(self.block_table),
            block_size=self.block_size,
            mask_id=self.ids.mask,
            backend=self.backend,
        )
        with attention_metadata(inputs.metadata), self.model_context(len(inputs.input_ids)):
            hidden = self.model(torch.zeros_like(inputs.input_ids), inputs.positions)
        rows = min(self.max_num_logits, len(hidden))
        logits = self.lm_head.project(hidden[:rows])
        # The costliest reduction: a float64 softmax and cumulative sum over every row.
        cdf = torch.cumsum(torch.softmax(logits.double(), dim=-1), dim=-1)
        del cdf, logits, hidden
