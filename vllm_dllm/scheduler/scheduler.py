"""vLLM Scheduler subclass that runs one denoising step per engine step.

vLLM's queues, KV cache manager, stop checks and output plumbing are kept; the step
plan (scheduler/plan.py) replaces the autoregressive token scheduling.  A request
gets the KV blocks for its whole sequence (prompt + canvas, twice with CFG; with the
sparse cache only the kept positions and the block, kv_footprint.py) when it is
admitted, so a running request never runs short of KV.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreEventType, EngineCoreOutput, EngineCoreOutputs
from vllm.v1.request import Request, RequestStatus

from vllm_dllm.log import get_logger
from vllm_dllm.serving.compat import cached_request_data, new_request_data, output_rows
from vllm_dllm.engine.constraints import GrammarStep
from vllm_dllm.kv_footprint import request_slots
from vllm_dllm.serving.metrics import StepStats
from vllm_dllm.options import DecodeOptions, sequence_copies
from vllm_dllm.phases import is_block_causal, keeps_cache_over_preemption
from vllm_dllm.scheduler.accounting import ComputedTokensAccounting
from vllm_dllm.scheduler.admission import Limits, price_request
from vllm_dllm.scheduler.plan import Candidate, Holder, choose_preemptions, plan_step
from vllm_dllm.scheduler.track import RequestTrack
from vllm_dllm.scheduler.prefix_cache import leading_blocks, usable_prefix
from vllm_dllm.scheduler.structured import StructuredOutputs
from vllm_dllm.serving.server_config import prefill_chunk, server_defaults

logger = get_logger(__name__)


@dataclass
class DiffusionSchedulerOutput(SchedulerOutput):
    """vLLM's scheduler output plus the decoding options of the step's new requests
    (resolved once, at admission) and the step's structured-output decisions
    (engine/constraints.py; None when no request of the step has a grammar)."""

    options: dict[str, DecodeOptions] = field(default_factory=dict)
    grammar: GrammarStep | None = None
    steps: int = 1  # denoising steps the call runs (scheduler/track.py steps_in_call)


class DiffusionScheduler(ComputedTokensAccounting, Scheduler):
    # ComputedTokensAccounting keeps request.num_computed_tokens consistent across
    # vLLM versions; it wraps Scheduler.update_from_output.

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.defaults = server_defaults(self.vllm_config)
        self.admission = self.defaults.admission
        # Lookahead and reserve price requests by their future steps.
        self.needs_profiles = self.admission in ("lookahead", "reserve")
        self.block_size = self.cache_config.block_size
        self.prefill_chunk = prefill_chunk(self.vllm_config)
        self._costs: dict[str, RequestTrack] = {}
        self._rejected: dict[str, str] = {}
        self._likelihoods: dict[str, dict] = {}  # ELBO estimates, until their request finishes
        self._step_stats: StepStats | None = None
        self._delayed = 0  # running requests that sat the last planned step out
        # Structured outputs (scheduler/grammar.py): where each request's streamed
        # tokens broke its grammar (sent with the next step), the bitmask rows, and
        # the tokens forced this step (for the step's stats).
        self._structured = StructuredOutputs(self.structured_output_manager, self.max_num_running_reqs)

    # ---- admission ----------------------------------------------------------

    def add_request(self, request: Request) -> None:
        super().add_request(request)
        reason = self._admission_problem(request)
        if reason is not None:
            logger.warning("Rejecting request %s: %s", request.request_id, reason)
            self._rejected[request.request_id] = reason

    def _admission_problem(self, request: Request) -> str | None:
        limits = Limits(
            max_model_len=self.max_model_len, max_num_scheduled_tokens=self.max_num_scheduled_tokens,
            block_size=self.block_size, pool_blocks=self.kv_cache_manager.block_pool.num_gpu_blocks - 1,
            prefill_chunk=self.prefill_chunk,
        )
        track = price_request(request.sampling_params, request.num_prompt_tokens, self.defaults, limits)
        if isinstance(track, str):
            return track
        self._costs[request.request_id] = track
        return None

    # ---- one step -----------------------------------------------------------

    def _candidate(self, request: Request, running: bool) -> Candidate:
        track = self._costs[request.request_id]
        return Candidate(
            request.request_id,
            track.tokens,
            0 if running else track.blocks,
            track.profile() if self.needs_profiles else (),
        )

    def _grammar_ready(self, request: Request) -> bool:
        """A request waiting for its grammar to compile is not admitted; a failed
        compilation finishes it with vLLM's error at the end of the step."""
        if request.status != RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR:
            return True
        grammar = request.structured_output_request.grammar if request.structured_output_request else None
        if grammar is None:
            return False
        if isinstance(grammar, Exception):
            self.grammar_compile_error_reqs.add(request.request_id)
            return False
        request.status = RequestStatus.WAITING
        return True

    def _waiting_in_order(self) -> list[Request]:
        waiting = [r for r in self.waiting if r.request_id not in self._rejected and self._grammar_ready(r)]
        if self.policy == SchedulingPolicy.PRIORITY:
            waiting.sort(key=lambda r: (r.priority, r.arrival_time))
        return waiting

    def _prefix_hit(self, request: Request, track: RequestTrack):
        """Positions of a block-causal request's prompt the prefix cache holds exactly
        (scheduler/prefix_cache.py), and their KV blocks; (0, None) otherwise."""
        if not (self.kv_cache_manager.enable_caching and is_block_causal(track.options)):
            return 0, None
        found = self.kv_cache_manager.get_computed_blocks(request)
        hit = usable_prefix(found[1], track.prompt_len, track.options.block_length, self.block_size)
        return hit, (leading_blocks(found[0], hit, self.block_size) if hit else None)

    def _offer_to_prefix_cache(self, req_id: str, track: RequestTrack) -> None:
        """Hand vLLM's prefix cache the KV blocks of a block-causal request that hold
        final K/V of its tokens (prompt, then finished canvas blocks: a multi-turn
        chat's next prompt finds its earlier turns), never blocks still written."""
        if not (self.kv_cache_manager.enable_caching and is_block_causal(track.options)):
            return
        request = self.requests.get(req_id)
        exact = track.exact_prefix()
        if request is None or exact <= track.cached:
            return
        track.cached = exact
        # vLLM hashes only tokens it holds: the output streamed so far.
        self.kv_cache_manager.cache_blocks(request, min(exact, request.num_tokens))

    def _preempt_for(self, newcomer: Request) -> None:
        """Under priority scheduling, free KV for a higher-priority request by
        preempting lower-priority running ones.  Their canvases stay in the worker;
        they resume with a full-sequence step, so exact decoding is unchanged."""
        victims = choose_preemptions(
            self._costs[newcomer.request_id].blocks,
            self.kv_cache_manager.block_pool.get_num_free_blocks(),
            (newcomer.priority, newcomer.arrival_time),
            [
                Holder(r.request_id, (r.priority, r.arrival_time), self._costs[r.request_id].blocks)
                for r in self.running
            ],
        )
        if not victims:
            return
        now = time.monotonic()
        chosen = {self.requests[req_id] for req_id in victims}
        self.running = [r for r in self.running if r not in chosen]
        for request in chosen:
            logger.info("Preempting request %s for higher-priority %s", request.request_id, newcomer.request_id)
            self._preempt_request(request, now)

    def _preempt_request(self, request: Request, timestamp: float, drop_stale_output: bool = False) -> None:
        # Every preemption (ours, or vLLM's own e.g. reset_prefix_cache) frees the
        # request's KV: its next step must be a Refresh.
        track = self._costs.get(request.request_id)
        if track is not None:
            # A block-causal request recomputes its prefix from its tokens instead.
            track.evicted = track.evicted or (track.has_cache and keeps_cache_over_preemption(track.options))
            track.has_cache = False
            track.prefilled = track.cached = 0
        super()._preempt_request(request, timestamp, drop_stale_output)

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        waiting = self._waiting_in_order()
        if waiting and self.policy == SchedulingPolicy.PRIORITY:
            self._preempt_for(waiting[0])
            waiting = self._waiting_in_order()
        plan = plan_step(
            [self._candidate(r, running=True) for r in self.running],
            [self._candidate(r, running=False) for r in waiting],
            token_budget=self.max_num_scheduled_tokens,
            max_seqs=self.max_num_running_reqs,
            free_blocks=self.kv_cache_manager.block_pool.get_num_free_blocks(),
            admission=self.admission,
        )
        self._delayed = len(self.running) - len(plan.scheduled)
        now = time.monotonic()
        new_reqs: list[NewRequestData] = []
        for req_id in plan.admitted:
            request = self.requests[req_id]
            # KV for the whole sequence (both CFG twins), whatever the step costs.
            track = self._costs[req_id]
            hit, cached = self._prefix_hit(request, track)
            if self.kv_cache_manager.allocate_slots(
                request, track.blocks * self.block_size - hit, num_new_computed_tokens=hit,
                new_computed_blocks=cached, has_scheduled_reqs=False,
                # Blocks enter the prefix cache once their K/V are final (_offer_to_prefix_cache).
                delay_cache_blocks=True,
            ) is None:
                # The pool's own accounting disagrees with the plan: wait for frees.
                for later in plan.admitted[plan.admitted.index(req_id):]:
                    plan.num_tokens.pop(later)
                break
            held = len(self.kv_cache_manager.get_blocks(req_id).get_block_ids()[0])
            if held != track.blocks:
                raise RuntimeError(f"request {req_id} got {held} KV blocks, needs {track.blocks}")
            if self.kv_cache_manager.enable_caching:
                self.kv_cache_manager.record_prefix_cache_stats(request, hit)
            # The runner reads where the request's prefill starts from here.
            request.num_computed_tokens = track.prefilled = hit
            plan.num_tokens[req_id] = track.tokens  # priced before the hit was known
            self.waiting.remove_request(request)
            # vLLM parks a request that waited for its grammar in deferred_waiting and
            # drops it there when its own schedule() admits it: so do we, or the
            # waiting gauges drift and the set keeps every such request alive.
            self.deferred_waiting.discard(request)
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            if self.log_stats:
                request.record_event(EngineCoreEventType.SCHEDULED, now)
            new_reqs.append(new_request_data(request, self.kv_cache_manager.get_blocks(req_id).get_block_ids()))
        grammar = self._structured.plan([self.requests[r] for r in plan.num_tokens], self._costs)
        steps = self._steps_in_call(plan, waiting, grammar)
        if steps > 1:
            for req_id in plan.num_tokens:
                plan.num_tokens[req_id] = self._costs[req_id].call_tokens(steps)
        running = [self.requests[req_id] for req_id in plan.scheduled]
        cached = cached_request_data(
            list(plan.scheduled),
            num_computed_tokens=[r.num_computed_tokens for r in running],
            num_output_tokens=[r.num_output_tokens for r in running],
        )
        for req_id, tokens in plan.num_tokens.items():
            self.requests[req_id].num_in_flight_tokens += tokens
        output = DiffusionSchedulerOutput(
            scheduled_new_reqs=new_reqs,
            options={new.req_id: self._costs[new.req_id].options for new in new_reqs},
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=dict(plan.num_tokens),
            total_num_scheduled_tokens=sum(plan.num_tokens.values()),
            scheduled_spec_decode_tokens={},
            scheduled_encoder_inputs={},
            finished_req_ids=self.finished_req_ids,
            free_encoder_mm_hashes=[],
            preempted_req_ids=self.reset_preempted_req_ids,
            grammar=grammar,
            steps=steps,
        )
        self.finished_req_ids = set()
        self.reset_preempted_req_ids = set()
        return output

    def _steps_in_call(self, plan, waiting: list[Request], grammar: GrammarStep | None) -> int:
        """Denoising steps the engine call runs: one while a grammar steers the step
        or a waiting request could be admitted at the next step (it waits at most one
        call); else as many as every scheduled request allows (track.steps_in_call),
        up to the server's `max_steps_per_call`."""
        limit = self.defaults.max_steps_per_call
        if limit <= 1 or not plan.num_tokens or grammar is not None or self._admissible(plan, waiting):
            return 1
        return min(self._costs[req_id].steps_in_call(limit) for req_id in plan.num_tokens)

    def _admissible(self, plan, waiting: list[Request]) -> bool:
        """Whether a request left waiting could start once this step's budget frees:
        a free sequence and the KV blocks for it (no Reuse step frees either)."""
        left = [r for r in waiting if r.request_id not in plan.num_tokens]
        if not left or (self.admission == "static" and self.running):
            return False
        if len(self.running) >= self.max_num_running_reqs:
            return False
        free = self.kv_cache_manager.block_pool.get_num_free_blocks()
        return self._costs[left[0].request_id].blocks <= free

    def update_from_output(self, scheduler_output, model_runner_output):
        returned = self._structured.validate(model_runner_output, self.requests, self._costs) if self._costs else 0
        self._step_stats = self._measure_step(scheduler_output, model_runner_output)
        self._structured.restart_returned_blocks(self._costs)
        forced = self._structured.take_forced()
        if self._step_stats is not None:
            self._step_stats.returned_tokens, self._step_stats.forced_tokens = returned, forced
        self._likelihoods.update(getattr(model_runner_output, "likelihoods", None) or {})
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if self._likelihoods:
            self._attach_likelihoods(outputs)
        self._step_stats = None
        if self._rejected:
            reasons, self._rejected = self._rejected, {}
            for request in self.finish_requests(list(reasons), RequestStatus.FINISHED_ERROR):
                outputs.setdefault(request.client_index, EngineCoreOutputs()).outputs.append(
                    EngineCoreOutput(
                        request_id=request.request_id,
                        new_token_ids=[],
                        finish_reason=request.get_finished_reason(),
                        stop_reason=reasons[request.request_id],
                        events=request.take_events(),
                    )
                )
        for req_id in [r for r in self._costs if r not in self.requests]:
            del self._costs[req_id]
        return outputs

    def _attach_likelihoods(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        """A request's ELBO rides every output of it from its scoring step on, in the
        field vLLM passes from the engine to the response as it is
        (`kv_transfer_params`): the front end may end the request on any of them (a
        stop string), and its final response takes that output's field."""
        for engine_outputs in outputs.values():
            for output in engine_outputs.outputs:
                value = self._likelihoods.get(output.request_id)
                if value is not None:
                    output.kv_transfer_params = {**(output.kv_transfer_params or {}), "likelihood": value}
        for req_id in [r for r in self._likelihoods if r not in self.requests]:
            del self._likelihoods[req_id]  # finished, or aborted

    def _measure_step(self, scheduler_output, model_runner_output) -> StepStats | None:
        """Advance each scheduled request past the call and count what its steps did."""
        scheduled = scheduler_output.num_scheduled_tokens
        if not scheduled:
            return None
        ran = getattr(model_runner_output, "steps", 1)  # steps the call ran (a block may end it early)
        stats = StepStats(
            committed_tokens=sum(len(tokens) for tokens in model_runner_output.sampled_token_ids),
            query_tokens=getattr(model_runner_output, "query_tokens", 0) or scheduler_output.total_num_scheduled_tokens,
            logits_rows=getattr(model_runner_output, "logits_rows", 0),
            delayed_steps=self._delayed,
            edited_tokens=getattr(model_runner_output, "edits", 0),
        )
        progress = getattr(model_runner_output, "progress", None) or None
        rows = output_rows(model_runner_output)
        for req_id in scheduled:
            track = self._costs.get(req_id)
            if track is None:
                continue
            phase = track.phase()
            if not phase.decodes:  # a prefill chunk: K/V only, no denoising
                track.advance(phase, None)
                self._offer_to_prefix_cache(req_id, track)
                continue
            stats.denoising_steps += ran
            stats.canvas_positions += track.canvas * ran
            later = track.later_phase() if ran > 1 else None
            refreshes = phase.refresh + (ran - 1) * bool(later and later.refresh)
            stats.refresh_steps += refreshes
            stats.reuse_steps += ran - refreshes
            stats.cache_rebuilds += track.needs_rebuild
            index = rows.get(req_id)
            block = track.block
            track.advance(phase, progress[index] if progress is not None and index is not None else None)
            stats.completed_blocks += max(track.block - block, 0)
            self._offer_to_prefix_cache(req_id, track)
        return stats

    def make_stats(self, spec_decoding_stats=None, *args, **kwargs):
        stats = super().make_stats(spec_decoding_stats, *args, **kwargs)
        if stats is not None and self._step_stats is not None:
            # The KV gauges count the requests still running after the step (the
            # moment of vLLM's num_running_reqs): a step that finishes the last
            # request reports 0, not what the finished requests held.
            for request in self.running:
                track = self._costs.get(request.request_id)
                if track is not None:
                    self._step_stats.kv_slots += request_slots(track.options, track.prompt_len)
                    self._step_stats.kv_dense_slots += (track.prompt_len + track.canvas) * sequence_copies(track.options)
            stats.spec_decoding_stats = self._step_stats.to_spec_decoding_stats()
        return stats
