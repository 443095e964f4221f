"""What the scheduler keeps per request to price its next steps: the request's
options, where it is in its canvas (block, step in block, cache), and the query
tokens of its next step and of every remaining one.  Pure: no vLLM."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_dllm.options import DecodeOptions, sequence_copies
from vllm_dllm.phases import StepPhase, block_phase


@dataclass
class RequestTrack:
    """What the scheduler keeps per request to price its next step."""

    options: DecodeOptions
    prompt_len: int
    blocks: int  # KV blocks for the whole sequence (twice with CFG)
    block: int = 0  # the active canvas block (the runner reports it after each step)
    block_step: int = 0  # steps run in it
    has_cache: bool = False  # its blocks hold a Refresh's K/V
    evicted: bool = False  # preemption freed its cache: the next step rebuilds or refreshes it
    prefilled: int = 0  # block-causal, no cache yet: positions whose K/V its blocks hold
    chunk: int = 0  # block-causal: the server's prefill chunk (phases.block_causal_phase)
    cached: int = 0  # block-causal: positions offered to vLLM's prefix cache so far
    scoring: int = 0  # query tokens of its prompt_logprobs copies and ELBO samples, run with its first step
    scores: bool = False  # its first step scores its prompt (even with no tokens: a one-token prompt)
    # Structured outputs (scheduler/completion.py): tokens its grammar needs to complete
    # the document from the accepted prefix (None: not worked out yet), and whether
    # the canvas was found too short for any document, and whether to complete it
    # from the next step on (its last step's tokens outgrew the room left).
    grammar_need: int | None = None
    grammar_short: bool = False
    grammar_close: bool = False

    @property
    def canvas(self) -> int:
        return self.options.gen_length

    @property
    def steps_per_block(self) -> int:
        return self.options.max_steps_per_block

    @property
    def num_blocks(self) -> int:
        return self.options.num_blocks

    @property
    def tokens(self) -> int:
        """Query tokens of its next step."""
        rebuild = self.prompt_len + self.canvas if self.needs_rebuild else 0
        return (self.phase().num_queries + rebuild) * sequence_copies(self.options) + self.scoring

    def phase(self) -> StepPhase:
        """Refresh or Reuse, and the queries of its next step (an evicted cache counts:
        the step rebuilds it)."""
        return block_phase(self.options, self.block, self.block_step, self.prompt_len, self.has_cache or self.evicted,
                           self.prefilled, self.chunk)

    @property
    def needs_rebuild(self) -> bool:
        """Its next step is a Reuse of a cache preemption freed: the step first reruns
        the last Refresh's canvas (phases.py)."""
        return self.evicted and not self.phase().refresh

    def steps_in_call(self, limit: int) -> int:
        """How many of its next steps one engine call may run (at most `limit`): the
        first, then steps of the same block that repeat one phase (the engine lays
        them out once), each no larger than the first.  A step that scores its prompt,
        prefills or rebuilds a cache runs alone.  A parallel decoding rule may end the
        block sooner: the engine then stops the call there."""
        first = self.phase()
        if limit <= 1 or self.scores or self.scoring or self.needs_rebuild or not first.decodes:
            return 1
        later = self.later_phase()
        if later.refresh and getattr(self.options, "cache", "none") != "none":
            return 1  # a Refresh that fills a cache (or keeps its canvas) runs alone
        if later.num_queries > first.num_queries:
            return 1
        steps = 1
        while steps < limit and self.block_step + steps < self.steps_per_block:
            if self._phase_at(self.block_step + steps) != later:
                break
            steps += 1
        return steps

    def later_phase(self) -> StepPhase:
        """The phase of the step after the next one, in the same block."""
        return self._phase_at(self.block_step + 1)

    def _phase_at(self, block_step: int) -> StepPhase:
        # After a decoding step the request has a cache (a Refresh filled it).
        return block_phase(self.options, self.block, block_step, self.prompt_len, True, self.prefilled, self.chunk)

    def call_tokens(self, steps: int) -> int:
        """Query tokens of a call running its next `steps` steps (steps_in_call)."""
        if steps == 1:
            return self.tokens
        return self.tokens + (steps - 1) * self.later_phase().num_queries * sequence_copies(self.options)

    def profile(self) -> tuple[int, ...]:
        """Query tokens of every remaining step, were every block to take the fixed
        schedule's steps (an upper bound on the number of steps under every rule)."""
        copies = sequence_copies(self.options)
        costs, has_cache, prefilled = [], self.has_cache or self.evicted, self.prefilled
        rebuild = self.prompt_len + self.canvas if self.needs_rebuild else 0
        for block in range(self.block, self.num_blocks):
            for block_step in range(self.block_step if block == self.block else 0, self.steps_per_block):
                while True:  # prefill chunks first, then the step itself
                    phase = block_phase(self.options, block, block_step, self.prompt_len, has_cache, prefilled, self.chunk)
                    costs.append((phase.num_queries + rebuild) * copies)
                    if phase.decodes:
                        break
                    prefilled = phase.query_end
                has_cache, rebuild = has_cache or phase.refresh, 0
        if costs:
            costs[0] += self.scoring
        return tuple(costs)

    def exact_prefix(self) -> int:
        """Block-causal: leading positions whose K/V in its blocks are final (written
        from their final tokens, never written again): the prefill so far, then the
        prompt's whole blocks and every canvas block whose successor has run a step
        (that step rewrote it from its final tokens)."""
        if not self.has_cache:
            return self.prefilled
        length = self.options.block_length
        whole = self.prompt_len - self.prompt_len % length
        return whole + max(self.block - (self.block_step == 0), 0) * length

    def advance(self, phase: StepPhase, reported: tuple[int, int] | None) -> None:
        """After a call whose first step was of `phase`: the runner's report of
        (block, step in block), or the fixed schedule's next step when there is none
        (a call of one step)."""
        self.scoring, self.scores = 0, False
        if not phase.decodes:
            self.prefilled = phase.query_end
            return
        # A Refresh fills the cache; a rebuilt one is whole again either way.
        self.has_cache = self.has_cache or phase.refresh or self.evicted
        self.evicted = False
        if reported is not None:
            self.block, self.block_step = reported
        elif self.block_step + 1 >= self.steps_per_block:
            self.block, self.block_step = self.block + 1, 0
        else:
            self.block_step += 1
