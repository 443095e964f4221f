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
from collections.abc import Callable

import numpy as np
import torch

from vllm_dllm.attention.metadata import attention_metadata
from vllm_dllm.decoding.base import SpecialIds
from vllm_dllm.decoding.logits import LMHead, chunked_reduce
from vllm_dllm.decoding.logprobs import LogprobsCollector
from vllm_dllm.engine.batch import RequestBatch
from vllm_dllm.engine.batch_layout import BatchLayout, batch_layout, same_layout
from vllm_dllm.engine.batch_phases import POLICY_NONE
from vllm_dllm.engine.call_steps import LaterSteps
from vllm_dllm.engine.graphs import ReuseGraphs
from vllm_dllm.engine.prompt_scoring import ScoringContext
from vllm_dllm.engine.memory_profile import peak_step
from vllm_dllm.engine.step_graphs import StepGraphs
from vllm_dllm.engine.step_inputs import build_step_inputs, to_device
from vllm_dllm.engine.step_output import StepOutput
from vllm_dllm.log import get_logger

logger = get_logger(__name__)

ModelContext = Callable[[int], contextlib.AbstractContextManager]


def _no_context(num_tokens: int) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


_CANVAS = 5  # the report's first canvas column (after final, candidates, block, block step, edits)
# The most LM-head rows a step runs over whole candidate windows (window_candidates): on current
# GPUs an LM head of a few hundred rows costs about its weight's read, so extra rows are nearly free.
WINDOW_ROWS = 256


def _embedding_rows(model):
    """The model's input embedding weight, read when a smoothing request arrives
    (None: the model has no input_embedding)."""
    if not hasattr(model, "input_embedding"):
        return None
    return lambda: model.input_embedding().weight


class StepEngine(LaterSteps, RequestBatch):
    """A batch of requests (batch.py) and the step over any subset of them.

    `model(input_ids, positions)` returns hidden states and reads attention metadata
    from the context; `model.compute_logits(hidden_rows)` projects rows to the
    vocabulary (or `lm_head` to this rank's shard of it); `model.logits_shift`
    says whether token j is predicted from the hidden state at j - 1 (Dream) or at
    j (LLaDA).
    """

    def __init__(self, model, *, kind: str, ids: SpecialIds, capacity: int, max_model_len: int, block_size: int,
                 max_num_logits: int, backend, device: torch.device, cuda_graphs: bool = False,
                 max_graph_seqs: int = 64, graph_capture=None, model_context: ModelContext | None = None,
                 prefill_chunk: int = 0, max_logprobs: int = 20, lm_head: LMHead | None = None,
                 window_candidates: bool | None = None, step_graphs: bool = True):
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
        default the model's whole-vocabulary `compute_logits`.  `window_candidates`:
        a step's LM head runs over every column of each request's candidate window
        rather than its candidates alone, so no sync waits for their count (the
        rule's `denoise`); by default on CUDA, where the extra rows cost less than
        the host's wait.  `step_graphs`: where Reuse graphs and windows are on, a
        call's later steps replay whole-step graphs (step_graphs.py; the whole
        vocabulary's LM head only)."""
        super().__init__(kind=kind, ids=ids, capacity=capacity, max_model_len=max_model_len, block_size=block_size,
                         device=device, lm_head=lm_head or LMHead(model.compute_logits),
                         prefill_chunk=prefill_chunk, max_logprobs=max_logprobs,
                         embedding_rows=_embedding_rows(model))
        self.model = model
        self.model_context = model_context or _no_context
        self.max_num_logits = max_num_logits
        self.window_candidates = device.type == "cuda" if window_candidates is None else window_candidates
        self.backend = backend
        self.logits_shift = bool(getattr(model, "logits_shift", False))
        self.graphs = self.step_graphs = None
        self._call_logprobs_k: int | None = None  # the top logprobs this call's requests asked for
        self._call_smooths = False  # a request of this call smooths (IterSmooth)
        if cuda_graphs and (device.type == "cuda" or graph_capture is not None):
            if getattr(backend, "graph_safe", False):
                self.graphs = ReuseGraphs(
                    model, backend, device=device, block_size=block_size, max_blocks=self.block_table.shape[1],
                    max_seqs=max_graph_seqs, capture=graph_capture, model_context=self.model_context,
                )
            else:
                logger.info("CUDA graphs off: attention backend %r cannot be captured", backend.name)
        if step_graphs and self.graphs is not None and self.window_candidates and lm_head is None:
            self.step_graphs = StepGraphs(self.graphs)

    # ---- one step ------------------------------------------------------------

    def layout(self, slots: np.ndarray) -> BatchLayout:
        """The step's sequences for the requests in `slots` (batch_layout.py)."""
        return batch_layout(self.host, self.sparse, self.evicted, self.copies, slots)

    @torch.inference_mode()
    def step(self, req_ids: list[str], planned_tokens: list[int] | None = None, steps: int = 1) -> StepOutput:
        """Denoising steps of the requests `req_ids`: one, or up to `steps` while every
        request stays in its active block (the scheduler's steps_in_call: the steps
        after the first repeat one phase, laid out once).  Tokens come back once, at
        the end.

        `planned_tokens`, when given, is what the scheduler priced each request's
        call at; a mismatch means scheduler and engine disagree on the phases.
        """
        slots_host = np.array([self.slots[r] for r in req_ids], dtype=np.int64)
        batch = self.layout(slots_host)
        prompt_len = self.host.prompt_len[slots_host]
        tokens = (batch.tokens + self.prompt_scorer.step_tokens(slots_host, prompt_len)
                  + self.elbo_scorer.step_tokens(slots_host, prompt_len))
        later = self._later_layout(req_ids, slots_host, batch, steps) if steps > 1 else None
        if later is not None:
            tokens = tokens + (steps - 1) * later.tokens
        if planned_tokens is not None:
            planned = np.array(planned_tokens, dtype=np.int64)
            if not np.array_equal(planned, tokens):
                bad = np.flatnonzero(planned != tokens).tolist()
                raise RuntimeError(
                    "scheduler and engine disagree on query tokens: "
                    + ", ".join(f"{req_ids[i]} planned {planned_tokens[i]}, step has {int(tokens[i])}" for i in bad)
                )
        inputs = self._inputs(batch)
        self._call_smooths = self.smooth.asks(slots_host)
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
        ran = 1
        if len(decoding):
            slots_dec = slots_host[decoding]
            slots = to_device(slots_dec, self.device)
            width = int(h.gen_length[slots_dec].max())
            seqs = to_device(np.stack([batch.request_seq[decoding], batch.twin_seq[decoding]]), self.device)
            bases = self._row_bases(slots, seqs, inputs)
            tally = [self._denoise(slots_dec, slots, width, bases, batch.has_twins, hidden)]
            if later is not None:
                # Later steps laid out as the first (Refreshes without a cache, Reuse
                # steps inside a block) reuse its inputs.
                reuse = (inputs, bases) if same_layout(batch, later) else None
                ran = self._run_later_steps(slots_host, slots, width, later, steps, tally, reuse)
            report = self._report(slots, width, tally)
            progress = report[:, 2:4].numpy()
            h.block[slots_dec], h.block_step[slots_dec] = progress[:, 0], progress[:, 1]
            copies = self.copies[slots_dec].tolist()
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
                            progress=[tuple(p) for p in progress.tolist()], edits=edits, steps=ran,
                            query_tokens=int(batch.tokens.sum() + (ran - 1) * (later.tokens.sum() if later else 0)))
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

    def _inputs(self, batch: BatchLayout):
        return build_step_inputs(
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

    def _denoise(self, slots_host, slots, width, bases, has_twins, hidden,
                 first: bool = True) -> torch.Tensor:
        """The rule's step for the requests in `slots_host` (their candidates' rows of
        `hidden` from `bases`, _row_bases), and its tally per request: its LM-head rows
        (candidates, or a whole window), and [rows, edits] where the rule may rewrite
        committed tokens.  `first`: the call's first step (later ones keep the rule's
        batch-level facts)."""
        if first:  # the same requests through the call
            self._call_logprobs_k = self.logprobs.step_width(slots_host)
        logprobs_k = self._call_logprobs_k
        collector = (LogprobsCollector(logprobs_k, self.device, self.lm_head.vocab)
                     if logprobs_k is not None else None)
        before = self.decode.canvas[slots, :width].clone() if collector is not None else None
        if self._call_smooths:
            self.smooth.clear(slots)  # the forward read the last step's; this step records its own
        # Rows over each request's whole candidate window, a shape known on the host,
        # where nothing records per-row state on the way: no sync before the LM head.
        windows = self.window_candidates and collector is None and not self._call_smooths and self._masks is None
        window = self._window_rows(has_twins) if windows else 0
        done = self.rule.denoise(
            slots_host, slots, width,
            lambda rows, positions: self._reduce(hidden, bases, has_twins, slots, rows, positions, collector, window),
            prepare=first, window=window,
        )
        if collector is not None:
            # Every position whose token this step wrote (a commit or an edit) keeps
            # the logprob row of this step.
            written = self.decode.canvas[slots[done.rows], done.positions] != before[done.rows, done.positions]
            self.logprobs.record(slots_host, done.rows, done.positions, written, collector.result())
        candidates = torch.full_like(slots, done.window) if done.window else done.plan.candidates.sum(dim=1)
        if not self.rule.rewrites_committed:  # no edits to count
            return candidates
        return torch.stack([candidates, self.rule.edits(slots)], dim=1)

    @staticmethod
    def _window_rows(has_twins: bool) -> int:
        """The most LM-head rows of a step's windows (a CFG twin's rows count too)."""
        return WINDOW_ROWS // (2 if has_twins else 1)

    def _report(self, slots, width: int, tallies: list[torch.Tensor]) -> torch.Tensor:
        """Per request: the count of final tokens, the call's candidates, its (block,
        step in block), its edits (`tallies`: _denoise's, a step each), then its canvas."""
        decode = self.decode
        tally = torch.stack(tallies).sum(dim=0)
        tally = torch.stack([tally, torch.zeros_like(tally)], dim=1) if tally.dim() == 1 else tally
        final = self.rule.num_final(slots, width)
        return torch.cat(
            [final[:, None], tally[:, :1], decode.block[slots, None], decode.block_step[slots, None], tally[:, 1:],
             decode.canvas[slots, :width]], dim=1,
        ).to("cpu")  # the call's last sync: everything the host needs, in one copy

    def _keep_snapshots(self, slots_host: np.ndarray, batch: BatchLayout) -> None:
        """The canvas a cached request's Refresh runs on: what its cache holds until
        the next Refresh, kept to rebuild it should preemption free its blocks."""
        filled = slots_host[batch.refresh & (self.host.policy[slots_host] != POLICY_NONE)]
        if len(filled):
            index = to_device(filled, self.device)
            self.snapshot[index] = self.decode.canvas[index]

    def _forward(self, batch: BatchLayout, inputs) -> torch.Tensor:
        if self._call_smooths:  # eager: the input embeddings are the step's own
            with attention_metadata(inputs.metadata), self.model_context(len(inputs.input_ids)):
                embeds = self.smooth.add_to(self.model.embed_input_ids(inputs.input_ids), inputs.input_ids,
                                            inputs.token_source, self.ids.mask, inputs.row_rebuild)
                return self.model(inputs.input_ids, inputs.positions, inputs_embeds=embeds)
        key = None
        if self.graphs is not None and batch.fill is None:
            key = self.graphs.key(batch.sequences.num_queries, batch.refresh, inputs.metadata.has_kv_offset)
        if key is None:
            with attention_metadata(inputs.metadata), self.model_context(len(inputs.input_ids)):
                return self.model(inputs.input_ids, inputs.positions)
        return self.graphs.forward(key, inputs.input_ids, inputs.positions, inputs.metadata)

    def _row_bases(self, slots, seqs, inputs) -> torch.Tensor:
        """[2, R]: the hidden row of each request's canvas position 0 in its own
        sequence and in its twin's (the row before it for a shifted model, which the
        prompt's last token holds): a candidate's row is its base plus its position."""
        first = self.prompt_len[slots] - int(self.logits_shift) - inputs.query_start[seqs[0]]
        return inputs.query_start_loc[seqs] + first

    def _reduce(self, hidden, bases, has_twins: bool, slots, rows, positions, logprobs=None, window=False):
        """(token, confidence) of each candidate: its hidden row (`bases`,
        _row_bases; the twin's row too under CFG) through the LM head in chunks,
        reduced by the rule.  `window`: the rows are whole candidate windows, whose
        columns outside a request's queries read any row (their results drop)."""
        cand_slots = slots[rows]
        bases = bases[:, rows] + positions
        if window:
            bases = bases.clamp(0, len(hidden) - 1)
        uncond_rows = cfg_scale = grammar = None
        if self._masks is not None:
            grammar = (self._masks.bitmask, self._masks.rows_for(cand_slots, positions))
        if has_twins:
            uncond_rows = bases[1]
            cfg_scale = self.decode.cfg_scale[cand_slots]
        return chunked_reduce(
            hidden,
            bases[0],
            cand_slots,
            positions,
            self.lm_head.project,
            self.rule,
            self.max_num_logits,
            uncond_rows=uncond_rows,
            cfg_scale=cfg_scale,
            logprobs=logprobs,
            grammar=grammar,
            smooth=self._smooth_chunk if self._call_smooths else None,
        )

    def _smooth_chunk(self, logits, slots, positions) -> None:
        self.smooth.record(logits, slots, positions, self.decode.step[slots])

    # ---- memory profiling ----------------------------------------------------

    def profile_step(self, max_num_tokens: int) -> None:
        """A dummy step at the configured caps, so memory profiling sees the peak
        (engine/memory_profile.py)."""
        peak_step(self, max_num_tokens)
