"""A call's steps after its first (the step engine's; engine.py).  Imports no vLLM.

Every later step of a call repeats one layout: each request one step on in its
active block, its cache filled.  Between two steps the host reads whether the call
goes on (call_check.py; one sync).  Where the whole step can be captured
(step_graphs.py) it replays from a graph; otherwise it runs the forward (a Reuse
graph where one applies) and the rule eagerly.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from vllm_dllm.engine.batch_layout import BatchLayout, batch_layout
from vllm_dllm.engine.call_check import CallCheck
from vllm_dllm.engine.step_graphs import plain_facts
from vllm_dllm.engine.step_inputs import to_device


class LaterSteps:
    """StepEngine's later steps (a mixin: it reads the engine's batch, rule and
    graphs)."""

    def _later_layout(self, req_ids, slots_host: np.ndarray, batch: BatchLayout, steps: int) -> BatchLayout:
        """The layout of a call's steps after the first: every request one step on in
        its block, its cache filled.  A step that must run alone (a grammar's masks,
        prompt scoring, a prefill chunk or a cache rebuild) cannot start a call."""
        alone = [
            name for name, present in (
                ("structured outputs", self._masks is not None),
                ("prompt scoring", self.prompt_scorer.asks(slots_host) or self.elbo_scorer.asks(slots_host)),
                ("a prefill chunk", not batch.decodes.all()),
                ("a cache rebuild", batch.rebuild.any()),
            ) if present
        ]
        if alone:
            raise RuntimeError(f"a call of {steps} steps for {', '.join(req_ids)}: {', '.join(alone)} runs one step")
        host = dataclasses.replace(self.host, block_step=self.host.block_step.copy(),
                                   has_cache=self.host.has_cache.copy())
        host.block_step[slots_host] += 1
        host.has_cache[slots_host] = True
        evicted = self.evicted.copy()
        evicted[slots_host] = False  # the first step refreshes an evicted cache
        return batch_layout(host, self.sparse, evicted, self.copies, slots_host)

    def _run_later_steps(self, slots_host, slots, width, later: BatchLayout, steps: int, tally, reuse=None):
        """Steps 2..`steps` of a call over one layout, while the call goes on;
        `reuse`: the first step's (inputs, row bases) when its layout is `later`.
        Appends each step's tally to `tally`; returns the steps run."""
        check = CallCheck.gather(self.stop_ids[slots], self.decode.output_length[slots], width)
        inputs, bases = reuse or (None, None)
        built = False  # inputs were built for this step: they read the canvas already
        graph_key = graphed = None
        ran = 1
        for _ in range(1, steps):
            goes_on = self._goes_on(slots, width, check) if graphed is None else graphed[-1]
            if not goes_on.item():
                break
            if inputs is None:
                inputs, built = self._inputs(later), True
                seqs = to_device(np.stack([later.request_seq, later.twin_seq]), self.device)
                bases = self._row_bases(slots, seqs, inputs)
            if ran == 1:
                graph_key = self._step_graph_key(slots_host, width, later, inputs)
            if graph_key is not None:
                graphed = self.step_graphs.run(
                    graph_key, inputs, slots, bases, self.decode.canvas,
                    lambda hidden, slots_, bases_: self._graphed_step(slots_host, slots_, width, bases_, later,
                                                                      hidden),
                    (self.decode, *self.rule.slot_holders()), load=ran == 1,
                )
                if graphed is None:  # no memory for the capture: what it ran is undone
                    graph_key = None
                    self.rule.start_over()
            if graphed is not None:
                step_tally = graphed[:-1].view(len(slots_host), -1)
                tally.append((step_tally[:, 0] if step_tally.shape[1] == 1 else step_tally).clone())
            else:
                if not built:
                    inputs.read_tokens(self.decode.canvas)
                hidden = self._forward(later, inputs)
                tally.append(self._denoise(slots_host, slots, width, bases, later.has_twins, hidden, first=False))
            built = False
            ran += 1
        if graph_key is not None:
            self.rule.last_step = None  # the capture's, not this call's
        return ran

    def _goes_on(self, slots, width: int, check: CallCheck) -> torch.Tensor:
        """Whether a call runs another step (call_check.py), from what the last
        commit wrote: the canvas rows and which blocks it ended."""
        last = self.rule.last_step
        if self.rule.rewrites_committed:
            waiting = check.waiting(last.rows, self.rule.num_final(slots, width))
        else:
            waiting = check.waiting_at_masks(last.rows, self.ids.mask)
        return check.goes_on(last.block_ended, waiting)

    def _step_graph_key(self, slots_host, width: int, later: BatchLayout, inputs) -> tuple | None:
        """The whole-step graph key of this call's later steps (step_graphs.py), or
        None where they run step by step: a graph needs a Reuse forward graph and an
        LM head over whole windows, with nothing recorded per row on the way."""
        if self.step_graphs is None or self._call_logprobs_k is not None or self._call_smooths:
            return None
        if len(slots_host) > self.step_graphs.max_requests or later.fill is not None:
            return None
        forward_key = self.graphs.key(later.sequences.num_queries, later.refresh, inputs.metadata.has_kv_offset)
        length = self.rule.window_fit(slots_host, self._window_rows(later.has_twins))
        if forward_key is None or not length:  # before the facts are gathered
            return None
        return self.step_graphs.key(
            forward_key, len(slots_host), width, length, (later.has_twins, plain_facts(self.rule.slot_holders())),
            inputs, (self.decode, *self.rule.slot_holders()),
        )

    def _graphed_step(self, slots_host, slots, width: int, bases, later: BatchLayout, hidden):
        """A later step after its forward as a graph captures it: the rule reads
        every value from the slots' state (a replay comes in later calls), then the
        check whether the call goes on."""
        self.rule.start_over()
        step_tally = self._denoise(slots_host, slots, width, bases, later.has_twins, hidden, first=False)
        check = CallCheck.gather(self.stop_ids[slots], self.decode.output_length[slots], width)
        return step_tally, self._goes_on(slots, width, check)
