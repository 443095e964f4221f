"""The diffusion model runner: one denoising step for every scheduled request.

Data path of a step: update request states from the scheduler output -> pack the
query tokens of every scheduled sequence into one varlen batch -> forward (attention
writes and reads the paged pool) -> for each request, only the hidden rows of
positions that still need a token go through the LM head, in chunks -> the decoding
rule commits tokens -> newly final tokens go back to vLLM's scheduler.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.model_executor.model_loader import get_model
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

from vllm_dllm.attention.context import attention_context
from vllm_dllm.decoding.base import DecodingRule, SpecialIds, make_rule
from vllm_dllm.decoding.logits import chunked_reduce
from vllm_dllm.options import resolve, sequence_copies
from vllm_dllm.phases import StepPhase, step_phase
from vllm_dllm.server_config import server_defaults
from vllm_dllm.worker.batch import PackedSequence, pack, slots_for
from vllm_dllm.worker.kv_pool import bind_kv_pool
from vllm_dllm.worker.special_ids import special_ids

logger = init_logger(__name__)


def unseeded_seed(req_id: str, engine_seed: int | None) -> int:
    """A request without a seed gets one from its id: different for every request,
    identical on every tensor-parallel rank (which must draw the same noise)."""
    digest = hashlib.blake2b(f"{engine_seed}:{req_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass
class DiffusionRunnerOutput(ModelRunnerOutput):
    """vLLM's runner output plus what the step cost, for the scheduler's metrics."""

    logits_rows: int = 0


@dataclass
class RequestState:
    req_id: str
    prompt: torch.Tensor
    rule: DecodingRule
    block_ids: list[int] = field(default_factory=list)
    emitted: int = 0
    has_cache: bool = False  # its KV blocks hold a Refresh's K/V

    @property
    def seq_len(self) -> int:
        return len(self.prompt) + self.rule.options.gen_length

    @property
    def uses_cfg(self) -> bool:
        return self.rule.options.uses_cfg

    def phase(self) -> StepPhase:
        return step_phase(self.rule.options, self.rule.step, len(self.prompt), self.has_cache)

    def sequences(self, block_size: int, phase: StepPhase) -> list[PackedSequence]:
        """This step's sequences: the canvas, and its prompt-masked twin under CFG."""
        tokens = torch.cat([self.prompt, self.rule.canvas])
        queries = torch.arange(phase.query_start, phase.query_end)
        slots = slots_for(self.block_ids, block_size, 0, self.seq_len)
        seqs = [PackedSequence(tokens, queries, slots, write_kv=phase.refresh)]
        if self.uses_cfg:
            uncond = tokens.clone()
            uncond[: len(self.prompt)] = self.rule.ids.mask
            twin_slots = slots_for(self.block_ids, block_size, self.seq_len, self.seq_len)
            seqs.append(PackedSequence(uncond, queries, twin_slots, write_kv=phase.refresh))
        return seqs

    def take_final_tokens(self) -> list[int]:
        final = self.rule.num_final()
        tokens = self.rule.canvas[self.emitted : final].tolist()
        self.emitted = final
        return tokens


class DiffusionModelRunner:
    # Capabilities vLLM's workers ask their runner about.
    is_pooling_model = False
    supports_mm_inputs = False
    lora_config = None

    def __init__(self, vllm_config: VllmConfig, device: torch.device):
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.device = device
        self.defaults = server_defaults(vllm_config)
        self.block_size = vllm_config.cache_config.block_size
        self.max_num_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        self.kv_cache_dtype = kv_cache_dtype_str_to_dtype(
            vllm_config.cache_config.cache_dtype, self.model_config
        )
        self.model = None
        self.kv_caches: list[torch.Tensor] = []
        self.states: dict[str, RequestState] = {}
        self.ids: SpecialIds | None = None

    # ---- worker surface ----------------------------------------------------

    def load_model(self, load_dummy_weights: bool = False) -> None:
        if load_dummy_weights:
            raise ValueError("dummy weights are not supported by the diffusion runner")
        self.model = get_model(vllm_config=self.vllm_config)
        self.ids = special_ids(self.model_config)
        logger.info("Diffusion model loaded; special ids %s", self.ids)

    def get_model(self):
        return self.model

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def update_max_model_len(self, max_model_len: int) -> None:
        self.model_config.max_model_len = max_model_len

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        return {
            layer.layer_name: FullAttentionSpec(
                block_size=self.block_size,
                num_kv_heads=layer.num_kv_heads,
                head_size=layer.head_dim,
                dtype=self.kv_cache_dtype,
                non_causal=True,
            )
            for layer in self.model.model.attention_layers()
        }

    def initialize_kv_cache(
        self, kv_cache_config: KVCacheConfig, is_profiling: bool = False, kv_cache_allocation_context=None
    ) -> None:
        self.kv_caches = bind_kv_pool(
            kv_cache_config, self.model.model.attention_layers(), self.kv_cache_dtype, self.device
        )

    def take_draft_token_ids(self):
        return None

    def get_draft_model(self):
        return None

    def get_encoder_timing_stats(self) -> dict:
        return {}

    def maybe_remove_all_loras(self, lora_config) -> None:
        return None

    def shutdown(self) -> None:
        self.states.clear()
        for layer in self.model.model.attention_layers() if self.model is not None else []:
            layer.kv_cache = None
        self.kv_caches = []

    def reset_mm_cache(self) -> None:
        return None

    def reset_encoder_cache(self) -> None:
        return None

    def sample_tokens(self, grammar_output) -> ModelRunnerOutput:
        # execute_model already returns the step's output; vLLM only asks here when
        # it returned None, which it never does.
        return EMPTY_MODEL_RUNNER_OUTPUT

    @torch.inference_mode()
    def profile_step(self) -> None:
        """A dummy step at the configured caps, so memory profiling sees the peak."""
        max_len = self.model_config.max_model_len
        remaining, sequences = self.max_num_tokens, []
        while remaining > 0:
            n = min(remaining, max_len)
            tokens = torch.zeros(n, dtype=torch.long)
            sequences.append(PackedSequence(tokens, torch.arange(n), torch.zeros(n, dtype=torch.long)))
            remaining -= n
        batch = pack(sequences, self.device)
        with attention_context(batch.context):
            hidden = self.model(batch.input_ids, batch.positions)
        rows = min(self.defaults.max_num_logits, len(hidden))
        logits = self.model.compute_logits(hidden[:rows])
        # The costliest reduction: Gumbel noise in float64 over every row.
        noise = torch.rand(logits.shape, dtype=torch.float64, device=logits.device)
        noisy = torch.exp(logits.double()) / (-torch.log(noise))
        del noisy, noise, logits, hidden

    warming_up_model = profile_step

    # ---- one step ------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput, intermediate_tensors=None) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        order = list(scheduler_output.num_scheduled_tokens)
        if not order:
            return EMPTY_MODEL_RUNNER_OUTPUT
        states = [self.states[req_id] for req_id in order]
        sequences, first_seq, phases = [], [], []
        for state in states:
            phase = state.phase()
            scheduled = scheduler_output.num_scheduled_tokens[state.req_id]
            expected = phase.num_queries * sequence_copies(state.rule.options)
            if scheduled != expected:
                raise RuntimeError(
                    f"request {state.req_id}: scheduler planned {scheduled} query tokens, "
                    f"its {'Refresh' if phase.refresh else 'Reuse'} step has {expected}"
                )
            phases.append(phase)
            first_seq.append(len(sequences))
            sequences.extend(state.sequences(self.block_size, phase))
        batch = pack(sequences, self.device)
        with attention_context(batch.context):
            hidden = self.model(batch.input_ids, batch.positions)
        new_tokens, logits_rows = [], 0
        for state, phase, seq_index in zip(states, phases, first_seq):
            logits_rows += self._denoise(state, phase, hidden, batch.query_starts, seq_index)
            state.has_cache = state.has_cache or phase.refresh
            new_tokens.append(state.take_final_tokens())
        return DiffusionRunnerOutput(
            req_ids=order,
            req_id_to_index={req_id: i for i, req_id in enumerate(order)},
            sampled_token_ids=new_tokens,
            logits_rows=logits_rows,
        )

    def _denoise(
        self, state: RequestState, phase: StepPhase, hidden: torch.Tensor, starts: list[int], seq_index: int
    ) -> int:
        """One denoising step of one request; returns the LM-head rows it computed."""
        rule = state.rule
        positions = rule.rows_needing_logits()
        source = self.model.prediction_rows(positions + len(state.prompt))
        if len(source) and (int(source.min()) < phase.query_start or int(source.max()) >= phase.query_end):
            raise RuntimeError(f"request {state.req_id}: a position needing logits is not a query this step")
        sequence_rows = (source - phase.query_start).to(self.device)
        cond_rows = starts[seq_index] + sequence_rows
        uncond_rows = starts[seq_index + 1] + sequence_rows if state.uses_cfg else None
        tokens, confidence = chunked_reduce(
            hidden,
            cond_rows,
            positions,
            self.model.compute_logits,
            rule.reduce,
            self.defaults.max_num_logits,
            uncond_rows=uncond_rows,
            cfg_scale=getattr(rule.options, "cfg_scale", 0.0),
        )
        rule.commit(positions, tokens, confidence)
        return len(cond_rows) * (2 if uncond_rows is not None else 1)

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self.states.pop(req_id, None)
        for req_id in scheduler_output.preempted_req_ids or ():
            if req_id in self.states:
                # Its KV blocks were freed: the step after resuming must Refresh.
                self.states[req_id].has_cache = False
        for new in scheduler_output.scheduled_new_reqs:
            state = self.states.get(new.req_id)
            if state is None:
                state = self._new_state(new)
                self.states[new.req_id] = state
            # A resumed request keeps its canvas; only its KV blocks are new.
            state.block_ids = list(new.block_ids[0])
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_blocks in zip(cached.req_ids, cached.new_block_ids):
            if new_blocks:
                self.states[req_id].block_ids.extend(new_blocks[0])

    def _new_state(self, new: NewRequestData) -> RequestState:
        params = new.sampling_params
        options = resolve(
            self.defaults,
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            extra_args=params.extra_args,
        )
        seed = params.seed if params.seed is not None else unseeded_seed(new.req_id, self.model_config.seed)
        prompt = torch.tensor(new.prompt_token_ids, dtype=torch.long)
        rule = make_rule(self.defaults.kind, options, self.ids, seed, prompt_len=len(prompt))
        return RequestState(req_id=new.req_id, prompt=prompt, rule=rule)
