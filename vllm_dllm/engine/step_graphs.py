"""CUDA graphs of a call's whole later steps.  Imports no vLLM.

A call's steps after its first repeat one layout (engine.py).  Where that layout is a
uniform Reuse (graphs.py's key) and the LM head runs over whole candidate windows
(the rule's `window_fit`: no sync sizes it), everything a step does has shapes the
host knows: reading the canvas into the input ids, the forward, the LM head, the
rule's plan, reduce and commit, and the check whether the call goes on.  That step is
captured once per key and replayed: one launch and one sync a step, where eagerly
every small op of the rule is a launch of its own.

What a replay reads and writes:
  * the forward's static buffers, padded to the sequence bucket as a Reuse graph's
    (graphs.py), so its forward runs the shapes, and so the kernels, of the eager
    path;
  * each row's token source, the requests' slots and their row bases: static buffers
    loaded at a call's first later step;
  * the state of the rule and the canvases, read and written in place.  A batch
    that grows its slots, or a rule that widens a table at admission, allocates
    tensors anew: every graph is then dropped (state_tensors).

Frozen at capture, and so in the key: the number of requests, the canvas width, the
windows' length, the rule's batch-level facts (`plain_facts`: what `prepare` and
admission decided on the host, which chooses the ops a step runs) and every buffer's
shape.  Capturing runs the step (torch's warm-up runs it twice, the CPU stand-ins
once), so the slots' state is kept before and put back after: the replay that
follows is the step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from vllm_dllm.engine.graphs import ForwardGraph, ReuseGraphs, has_room
from vllm_dllm.log import get_logger

logger = get_logger(__name__)

# The most requests a whole-step graph serves: the key holds their exact count (the
# rule's rows are not padded), and the host time it saves is what a few requests
# wait on; larger batches replay the forward graph and run the rule eagerly.
MAX_REQUESTS = 8

_PLAIN = (bool, int, float, str, type(None))


def plain_facts(holders) -> tuple:
    """Every plain attribute (bool, int, float, str, None, or a list or tuple of
    them) of `holders`, by name: the host-side facts that choose the ops of a rule's
    step.  Over-inclusive on purpose: a fact that does not change the ops only adds
    a key."""
    facts = []
    for index, holder in enumerate(holders):
        for name, value in sorted(vars(holder).items()):
            if isinstance(value, np.generic):  # a numpy scalar is a plain value too
                value = value.item()
            if isinstance(value, (list, tuple)) and all(isinstance(v, _PLAIN) for v in value):
                value = tuple(value)
            elif not isinstance(value, _PLAIN):
                continue
            facts.append((index, name, value))
    return tuple(facts)


def state_tensors(holders) -> tuple:
    """(holder, name, storage address, shape) of every tensor the holders keep: a
    graph reads them by address, so one that is allocated anew (slots grown, a
    table widened at admission) makes every graph stale."""
    return tuple((index, name, value.data_ptr(), tuple(value.shape))
                 for index, holder in enumerate(holders) for name, value in sorted(vars(holder).items())
                 if isinstance(value, torch.Tensor))


def slot_state(holders, capacity: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tensor, its copy) for every per-slot tensor of `holders` (first dimension
    `capacity`): what a step may write, kept so a capture can put it back."""
    return [(value, value.clone()) for holder in holders for value in vars(holder).values()
            if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == capacity]


@dataclass
class _StepGraph:
    forward: ForwardGraph  # the forward's buffers (graphs.py)
    token_source: tuple[torch.Tensor, ...]
    slots: torch.Tensor
    bases: torch.Tensor
    replay: Callable[[], None] = lambda: None
    output: torch.Tensor | None = None  # [tally..., goes on]

    def load(self, inputs, slots: torch.Tensor, bases: torch.Tensor) -> None:
        self.forward.load(inputs.input_ids, inputs.positions, inputs.metadata)
        for buffer, value in zip((*self.token_source, self.slots, self.bases), (*inputs.token_source, slots, bases)):
            buffer.copy_(value)


# step(hidden, slots, bases) -> (tally [R] or [R, 2], goes_on: bool 0-dim), the step
# after the forward, on the graph's buffers.
StepAfterForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class StepGraphs:
    """Captured later steps (forward to the call's check), keyed by (capacity, the
    forward's key, requests, width, window length, rule facts, buffer shapes)."""

    def __init__(self, forwards: ReuseGraphs, max_requests: int = MAX_REQUESTS):
        self.forwards = forwards
        self.max_requests = max_requests
        self.graphs: dict[tuple, _StepGraph] = {}
        self._state: tuple = ()
        self._warned_full = False

    def key(self, forward_key, num_requests: int, width: int, window: int, facts: tuple, inputs,
            holders) -> tuple | None:
        """The key of a later step that can replay a whole-step graph, else None.
        `holders`: what keeps the state a step reads and writes (state_tensors)."""
        if forward_key is None or not window or num_requests > self.max_requests or inputs.token_source is None:
            return None
        if inputs.row_rebuild is not None or inputs.metadata.cache_fill is not None:
            return None
        state = state_tensors(holders)
        if state != self._state:  # tensors allocated anew: the old graphs read freed ones
            self.graphs.clear()
            self._state = state
        shapes = tuple(tuple(t.shape) for t in inputs.token_source)
        key = (holders[0].capacity, forward_key, num_requests, width, window, facts, shapes)
        return key if has_room(self, key, "whole-step graphs captured; further shapes run step by step") else None

    @torch.inference_mode()
    def run(self, key: tuple, inputs, slots: torch.Tensor, bases: torch.Tensor, canvas: torch.Tensor,
            after_forward: StepAfterForward, holders, load: bool) -> torch.Tensor | None:
        """One later step from the graph of `key` (captured on first use): `load`,
        the call's first later step, copies its inputs into the buffers.  Returns the
        graph's output, [tally (flattened), goes on], valid until its next replay;
        None where the capture failed (out of device memory, or an op it cannot
        hold): the step then runs step by step, and no further shape is captured."""
        graph = self.graphs.get(key)
        fresh = graph is None
        if fresh:
            graph = self._buffers(key, inputs, slots, bases)
        if load or fresh:
            graph.load(inputs, slots, bases)
        if fresh and not self._capture(graph, key, inputs, canvas, after_forward, holders):
            return None
        graph.replay()
        return graph.output

    def _buffers(self, key, inputs, slots, bases) -> _StepGraph:
        forward = self.forwards.buffers(*key[1][:2])
        return _StepGraph(forward, tuple(t.clone() for t in inputs.token_source), slots.clone(), bases.clone())

    def _capture(self, graph: _StepGraph, key, inputs, canvas, after_forward: StepAfterForward, holders) -> bool:
        forward = self.forwards.static_forward(graph.forward, key[1], inputs.metadata)
        tokens = len(inputs.input_ids)
        in_prompt, from_prompt, row_slot, canvas_index = graph.token_source

        def step() -> torch.Tensor:
            graph.forward.input_ids[:tokens].copy_(torch.where(in_prompt, from_prompt, canvas[row_slot, canvas_index]))
            hidden = forward()[:tokens]
            tally, goes_on = after_forward(hidden, graph.slots, graph.bases)
            return torch.cat([tally.reshape(-1), goes_on.reshape(1).long()])

        kept = slot_state(holders, key[0])
        try:
            graph.replay, graph.output = self.forwards.capture(step, self.forwards.pool)
        except torch.cuda.OutOfMemoryError:
            # The graph's pool keeps what a step allocates: serving goes on without it.
            logger.warning("Out of device memory capturing a whole later step; later steps run step by step")
            self.max_requests = 0
            return False
        except Exception:  # an op the capture cannot hold: serve without, and say which
            logger.exception("Capturing a whole later step failed; later steps run step by step")
            self.max_requests = 0
            return False
        finally:
            if canvas.is_cuda:  # a warm-up's kernels may still be queued on its stream
                torch.cuda.synchronize()
            for value, copy in kept:
                value.copy_(copy)
        self.graphs[key] = graph
        logger.info("Captured a whole later step of %d requests x %d queries", key[2], key[1][1])
        return True
