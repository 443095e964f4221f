"""Batched decoding: the state every rule shares, the rule interface, the commit.

A rule decides, for all scheduled requests at once, which canvas positions need
logits this step and how many of them to commit (`plan`), what each candidate row's
token and confidence are (`reduce`, over a chunk of logits rows from any requests),
and how candidates are ranked (`ranking_keys`).  `commit` then writes the top-count
candidates of every request into its canvas.  Everything is tensor code over the
batch: no Python loop over requests, no host sync.

Per-request parameters live in per-slot tensors written once at admission; a
request's slot is its row in every tensor here.  Rules never see the model, the
batch layout or the KV cache.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from vllm_dllm.decoding.vocab import WHOLE, Vocab
from vllm_dllm.options import DecodeOptions

# Canvas entries past a request's generation length.  Never equal to a token id,
# so padding is never "masked" and never a candidate.
PAD = -1

# Ranking key of a candidate whose confidence is -inf: below every real confidence,
# above every non-candidate (-inf), so a request always commits `count` candidates.
_LOWEST_CANDIDATE = -torch.finfo(torch.float64).max


def even_split(total: torch.Tensor, steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's tokens over its steps: every step total // steps, the first
    total % steps steps one more (count_at)."""
    return total // steps, total % steps


def count_at(parts: tuple[torch.Tensor, torch.Tensor], step_in_block: torch.Tensor) -> torch.Tensor:
    """The count of an even_split at each request's step in its block."""
    share, extra = parts
    return share + (step_in_block < extra)  # long + bool: long


@dataclass(frozen=True)
class SpecialIds:
    mask: int
    eos: int
    eot: int | None = None


class DecodeState:
    """Canvases and the parameters every rule reads, one row per request slot, and
    the vocabulary the rules' logits rows span (this rank's shard under TP)."""

    def __init__(self, capacity: int, max_gen: int, ids: SpecialIds, device: torch.device, vocab: Vocab = WHOLE):
        self.ids = ids
        self.device = device
        self.vocab = vocab
        self.canvas = torch.full((capacity, max_gen), PAD, dtype=torch.long, device=device)
        self.gen_length = torch.zeros(capacity, dtype=torch.long, device=device)
        self.output_length = torch.zeros(capacity, dtype=torch.long, device=device)  # at most max_tokens out
        self.step = torch.zeros(capacity, dtype=torch.long, device=device)
        # Progress: the active block, steps run in it, the blocks of the canvas, and
        # the fixed schedule's steps per block (a block's upper bound under every rule).
        self.block = torch.zeros(capacity, dtype=torch.long, device=device)
        self.block_step = torch.zeros(capacity, dtype=torch.long, device=device)
        self.num_blocks = torch.ones(capacity, dtype=torch.long, device=device)
        self.steps_per_block = torch.ones(capacity, dtype=torch.long, device=device)
        self.seed = torch.zeros(capacity, dtype=torch.long, device=device)
        self.temperature = torch.zeros(capacity, dtype=torch.float32, device=device)
        self.cfg_scale = torch.zeros(capacity, dtype=torch.float32, device=device)
        # Host copy: whether a batch samples is decided without a device sync.
        self.temperature_host = np.zeros(capacity, dtype=np.float32)

    @property
    def capacity(self) -> int:
        return self.canvas.shape[0]

    def admit(self, slot: int, options: DecodeOptions, seed: int) -> None:
        self.canvas[slot] = PAD
        self.canvas[slot, : options.gen_length] = self.ids.mask
        self.gen_length[slot] = options.gen_length
        self.output_length[slot] = options.output_length
        self.step[slot] = 0
        self.block[slot] = 0
        self.block_step[slot] = 0
        self.num_blocks[slot] = options.num_blocks
        self.steps_per_block[slot] = options.steps_per_block
        # The Philox contract keys on seed mod 2**64; int64 holds it by two's
        # complement (the same 64 bits), so no bit of the seed is lost.
        seed %= 1 << 64
        self.seed[slot] = seed - (1 << 64) if seed >= 1 << 63 else seed
        self.temperature[slot] = options.temperature
        self.temperature_host[slot] = options.temperature
        self.cfg_scale[slot] = getattr(options, "cfg_scale", 0.0)

    def masked(self, slots: torch.Tensor, width: int) -> torch.Tensor:
        return self.canvas[slots, :width] == self.ids.mask

    def num_final(self, slots: torch.Tensor, width: int) -> torch.Tensor:
        """Length of each request's committed prefix: the tokens that can be streamed.

        Once its last block has ended a canvas is final whatever it holds, as the
        references return it then, even where a position was committed as the mask
        id itself.
        """
        masked = self.masked(slots, width)
        first_masked = torch.where(masked.any(dim=1), masked.int().argmax(dim=1), self.gen_length[slots])
        final = torch.where(self.block[slots] >= self.num_blocks[slots], self.gen_length[slots], first_masked)
        # A canvas padded to whole blocks holds more than the request asked for.
        return torch.minimum(final, self.output_length[slots])


@dataclass
class CandidatePlan:
    """What a rule decided before the forward: candidates and how many to commit."""

    candidates: torch.Tensor  # bool [R, width], canvas positions needing logits
    count: torch.Tensor  # long [R], candidates to commit (<= candidates per row)
    # long [R]: each request's steps so far in its active block, when the plan read
    # them (the commit then need not gather them again).
    step_in_block: torch.Tensor | None = None
    rows: torch.Tensor | None = None  # long [R, width]: the canvas rows the plan read (canvas_rows)
    window: torch.Tensor | None = None  # bool [R, width]: the active blocks' columns, where a rule keeps them


@dataclass
class Denoised:
    """One step's decisions: candidate i is (request rows[i], canvas position positions[i])."""

    plan: CandidatePlan
    rows: torch.Tensor
    positions: torch.Tensor
    tokens: torch.Tensor
    confidence: torch.Tensor
    window: int = 0  # > 0: the rows were whole candidate windows of this many columns a request


@dataclass
class StepEnd:
    """What a commit leaves for the engine's check before a call's next step."""

    rows: torch.Tensor  # long [R, width]: the requests' canvas rows after the commit
    block_ended: torch.Tensor  # bool [R]: the commit ended the request's active block


ReduceCandidates = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class BatchedRule(ABC):
    """One model kind's decoding algorithm over a batch of requests."""

    def __init__(self, state: DecodeState):
        self.state = state
        self.sampled = True
        # Values a call's first step computes and its later steps reuse (per_call).
        self._call_values: dict[str, object] = {}
        self._later = False
        # Whether a request of the batch may rewrite committed tokens of its active
        # block (token editing): its final prefix then ends before its first mask.
        self.rewrites_committed = False
        self.last_step: StepEnd | None = None  # the last commit's (commit)
        # Each slot's block length (admit_block_length), with a host copy.
        self.block_length = torch.ones(state.capacity, dtype=torch.long, device=state.device)
        self.block_length_host = np.ones(state.capacity, dtype=np.int64)

    def admit_block_length(self, slot: int, length: int) -> None:
        self.block_length[slot] = length
        self.block_length_host[slot] = length

    def prepare(self, slots_host) -> None:
        """Batch-level facts for this step, from host (numpy) copies of the
        parameters, so that work no row needs is skipped without a device sync."""
        self.sampled = bool((self.state.temperature_host[np.asarray(slots_host)] > 0).any())

    @property
    def ids(self) -> SpecialIds:
        return self.state.ids

    def slot_holders(self) -> tuple:
        """Objects whose per-slot tensors and arrays grow with the batch's slots."""
        return (self,)

    @abstractmethod
    def admit(self, slot: int, options: DecodeOptions) -> None:
        """Write the request's rule parameters into its slot (DecodeState.admit first)."""

    @abstractmethod
    def plan(self, slots: torch.Tensor, width: int) -> CandidatePlan:
        """Candidates and commit counts of this step, for the requests in `slots`."""

    @abstractmethod
    def reduce(
        self, logits: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(token, confidence) of each logits row; row i belongs to request slot
        `slots[i]`, canvas position `positions[i]`.  May modify `logits` in place."""

    def ranking_keys(self, slots: torch.Tensor, plan: CandidatePlan, confidence: torch.Tensor) -> torch.Tensor:
        """Keys by which each request's candidates compete for its `count` commits."""
        return confidence

    def denoise(
        self, slots_host, slots: torch.Tensor, width: int, reduce_candidates: ReduceCandidates, prepare: bool = True,
        window: int = 0,
    ) -> Denoised:
        """One denoising step of the requests in `slots` (`slots_host`: the same on
        the host): plan, `reduce_candidates(rows, positions) -> (tokens, confidence)`
        for the candidates as `plan.candidates.nonzero()` lists them (their count,
        which sizes the LM-head work, is the step's sync), commit.  `prepare` False:
        the batch-level facts of the last step still hold (the same requests, no
        admission since).

        `window` > 0, in a greedy step whose reduce reads nothing but its rows
        (`pure_reduce`; a sampled row's reduce is work over the whole vocabulary,
        which rows outside the candidates would multiply) and where the windows take
        at most that many rows: the rows are instead every column of each request's
        candidate window, a shape the host knows (window_rows), so the step needs no
        sync; rows that are not candidates get confidence -inf and are never
        committed.  Their hidden rows may lie outside the request's queries: the
        caller keeps their indices in range."""
        if prepare:
            self.prepare(slots_host)
            self._call_values.clear()
            self.last_step = None  # a call's later steps read the last commit's
        self._later = not prepare
        try:
            plan = self.plan(slots, width)
            length = self.window_fit(slots_host, window)
            if length:
                rows, positions = self.per_call("window_rows", lambda: self.window_rows(slots_host, slots, width))
                tokens, confidence = reduce_candidates(rows, positions)
                confidence = torch.where(plan.candidates[rows, positions], confidence, float("-inf"))
            else:
                rows, positions = plan.candidates.nonzero(as_tuple=True)
                tokens, confidence = reduce_candidates(rows, positions)
            self.commit_candidates(slots, plan, rows, positions, tokens, confidence)
        finally:
            self._later = False
        if self.last_step is None:
            raise RuntimeError(f"{type(self).__name__}.commit did not leave its StepEnd (last_step)")
        return Denoised(plan, rows, positions, tokens, confidence, min(length, width))

    def window_fit(self, slots_host, window: int) -> int:
        """The candidate windows' length where this step's rows may be whole windows
        of at most `window` rows in all (denoise), else 0."""
        if not window or self.sampled or not self.pure_reduce():
            return 0
        length = self.window_length(slots_host)
        return length if len(slots_host) * length <= window else 0

    def pure_reduce(self) -> bool:
        """Whether `reduce` this step reads only its rows' logits and parameters (no
        per-position state it also writes), so rows that are not candidates may
        pass through it."""
        return True

    def candidate_window(self, slots: torch.Tensor) -> torch.Tensor:
        """Each request's first canvas column that can hold a candidate this step:
        every candidate lies within `window_length` columns from it.  By default the
        active block's, blocks tiling the canvas from its first column."""
        return self.state.block[slots] * self.block_length[slots]

    def window_length(self, slots_host) -> int:
        """A bound, known on the host, on the columns of every request's candidate
        window (candidate_window): its block length."""
        return int(self.block_length_host[np.asarray(slots_host)].max())

    def window_rows(self, slots_host, slots: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(request row, canvas position) of every column of each request's candidate
        window, L a request (window_length, at most `width`): column j of request r
        is its start + j, or where that passes the canvas, width - 1 - j, a column
        before the window; so no pair repeats."""
        length = min(self.window_length(slots_host), width)
        columns = torch.arange(length, device=slots.device)
        positions = self.candidate_window(slots)[:, None] + columns
        positions = torch.where(positions < width, positions, width - 1 - columns)
        rows = torch.arange(len(slots), device=slots.device)[:, None].expand_as(positions)
        return rows.reshape(-1), positions.reshape(-1)

    def start_over(self) -> None:
        """Forget what a call's earlier steps left (per_call values, the last
        commit's rows): the next step reads everything from the slots' state, as a
        captured step does, whose replays come in later calls."""
        self._call_values.clear()
        self.last_step = None

    def per_call(self, name: str, compute: Callable[[], object]):
        """`compute()` at a call's first step (and whenever a rule is driven step by
        step), its value again at the call's later steps: for values that hold through
        a call, which stays in each request's block (admission-time parameters, the
        block's window and its count at its start)."""
        if self._later and name in self._call_values:
            return self._call_values[name]
        value = self._call_values[name] = compute()
        return value

    def canvas_rows(self, slots: torch.Tensor, width: int) -> torch.Tensor:
        """[R, width]: the requests' canvas rows as they are now (a call's later step:
        the rows its last commit wrote, with no gather).  Read-only."""
        if self._later and self.last_step is not None:
            return self.last_step.rows
        return self.state.canvas[slots, :width]

    def commit_candidates(
        self,
        slots: torch.Tensor,
        plan: CandidatePlan,
        rows: torch.Tensor,
        positions: torch.Tensor,
        tokens: torch.Tensor,
        confidence: torch.Tensor,
    ) -> None:
        """`commit` from per-candidate results: candidate i is (request rows[i],
        canvas position positions[i]), as `plan.candidates.nonzero()` lists them."""
        width = plan.candidates.shape[1]
        if plan.rows is None:
            grid_tokens = self.state.canvas[slots, :width]  # a copy: `slots` indexes
            grid_tokens[rows, positions] = tokens
        else:
            grid_tokens = plan.rows.index_put((rows, positions), tokens)
        grid_conf = torch.full(grid_tokens.shape, float("-inf"), dtype=confidence.dtype, device=confidence.device)
        grid_conf[rows, positions] = confidence
        self.commit(slots, plan, grid_tokens, grid_conf)

    def commit(self, slots: torch.Tensor, plan: CandidatePlan, tokens: torch.Tensor, confidence: torch.Tensor) -> None:
        """Commit each request's `count` highest-ranked candidates and advance a step.

        `tokens`/`confidence` are [R, width] grids, read only where candidates.
        Equal keys break toward the lower position: deterministic on every device
        and whatever else is in the batch.  (The references call torch.topk, whose
        order among ties depends on the device and the vector's length.)
        """
        state = self.state
        width = plan.candidates.shape[1]
        keys = self.ranking_keys(slots, plan, confidence).double().clamp(min=_LOWEST_CANDIDATE)
        keys = torch.where(plan.candidates, keys, float("-inf"))
        ordered, order = torch.sort(keys, dim=1, descending=True, stable=True)
        columns = self.per_call("columns", lambda: torch.arange(width, device=keys.device).expand_as(order))
        rank = torch.empty_like(order).scatter_(1, order, columns)
        chosen = rank < self.commit_count(slots, plan, ordered)[:, None]
        rows = torch.where(chosen, tokens, state.canvas[slots, :width] if plan.rows is None else plan.rows)
        state.canvas[slots, :width] = rows
        next_step = self.count_step(slots, plan)
        self.end_step(slots, rows, next_step, self.block_done(slots, plan, next_step))

    def count_step(self, slots: torch.Tensor, plan: CandidatePlan) -> torch.Tensor:
        """A commit's step counted; returns each request's steps in its block with it."""
        state = self.state
        # index_add_: a step's slots are distinct, and integers add exactly.
        state.step.index_add_(0, slots, self.per_call("ones", lambda: torch.ones_like(slots)))
        return (state.block_step[slots] if plan.step_in_block is None else plan.step_in_block) + 1

    def end_step(self, slots: torch.Tensor, rows: torch.Tensor, next_step: torch.Tensor, done: torch.Tensor) -> None:
        """After a commit wrote the canvas `rows`: each request's block advances where
        `done`, else its step in the block; the engine's check reads both (StepEnd)."""
        self.state.block.index_add_(0, slots, done.long())
        self.state.block_step[slots] = torch.where(done, 0, next_step)
        self.last_step = StepEnd(rows, done)

    def restart_block(self, slots: torch.Tensor, streamed: torch.Tensor) -> None:
        """The requests' active blocks restart from their first step (structured
        outputs returned committed tokens to the mask from canvas position
        `streamed` on; everything before it has streamed): per-block state of the
        rule starts over.  State kept per block start (e.g. a quota counted at step
        0) is recounted by the rule itself."""

    def edits(self, slots: torch.Tensor) -> torch.Tensor:
        """Committed tokens each request's last step rewrote (token editing)."""
        return torch.zeros_like(slots)

    def num_final(self, slots: torch.Tensor, width: int) -> torch.Tensor:
        """Length of each request's final prefix (streamable, never rewritten)."""
        return self.state.num_final(slots, width)

    def commit_count(self, slots: torch.Tensor, plan: CandidatePlan, ordered_keys: torch.Tensor) -> torch.Tensor:
        """How many candidates each request commits, given its ranking keys sorted
        descending (non-candidates last, at -inf): the plan's count, unless a rule
        decides from the confidences."""
        return plan.count

    def block_done(self, slots: torch.Tensor, plan: CandidatePlan, next_step: torch.Tensor) -> torch.Tensor:
        """Whether each request's active block ended with this step (after the
        commit), `next_step` being its steps in the block with this one: under the
        fixed schedule, after its steps per block."""
        state = self.state
        return next_step >= self.per_call("steps_per_block", lambda: state.steps_per_block[slots])
