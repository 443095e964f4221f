"""The diffusion model runner: vLLM's runner surface over the step engine.

A thin adapter: it loads the model and carves the KV pool with vLLM's pieces,
translates each SchedulerOutput into request events (new, resumed, preempted,
finished) and one `StepEngine.step`, and hands the newly final tokens back as a
ModelRunnerOutput.  The step itself lives in vllm_dllm/engine/.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field

import torch
from vllm.config import VllmConfig
from vllm.forward_context import set_forward_context
from vllm.model_executor.model_loader import get_model
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, LogprobsLists, LogprobsTensors, ModelRunnerOutput

from vllm_dllm.attention.backends import TorchAttention, select_backend
from vllm_dllm.log import get_logger
from vllm_dllm.serving.compat import runner_output_order
from vllm_dllm.engine.engine import StepEngine
from vllm_dllm.engine.graphs import capture_cuda_graph
from vllm_dllm.engine.likelihood import elbo_task
from vllm_dllm.models.token_chunks import limit_activations, logits_tile_bytes
from vllm_dllm.options import DecodeOptions
from vllm_dllm.serving.server_config import BLOCK_CAUSAL_KINDS, prefill_chunk, server_defaults
from vllm_dllm.worker.kv_pool import bind_kv_pool
from vllm_dllm.worker.special_ids import special_ids
from vllm_dllm.worker.vocab_parallel import vocab_parallel_head

logger = get_logger(__name__)


def unseeded_seed(req_id: str, engine_seed: int | None) -> int:
    """A request without a seed gets one from its id: different for every request,
    identical on every tensor-parallel rank (which must draw the same noise)."""
    digest = hashlib.blake2b(f"{engine_seed}:{req_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def prompt_logprobs_tensors(arrays) -> LogprobsTensors:
    """vLLM's tensors for one request's prompt logprobs (ids, logprobs, ranks).  An
    empty numpy array may carry a zero stride, which vLLM's serialiser cannot view as
    bytes (the engine core's output thread died on a one-token prompt): empties are
    made afresh."""
    return LogprobsTensors(*(
        torch.from_numpy(a) if a.size else torch.empty(a.shape, dtype=torch.from_numpy(a).dtype) for a in arrays
    ))


def stop_token_ids(params) -> tuple[int, ...]:
    """The tokens that finish a request in vLLM's stop check: its EOS (unless it
    ignores EOS) and its stop_token_ids."""
    eos = () if params.eos_token_id is None else (params.eos_token_id,)
    return tuple(dict.fromkeys((*eos, *(params.stop_token_ids or ()))))


def _device_memory_allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def new_request_options(scheduler_output: SchedulerOutput, req_id: str) -> DecodeOptions:
    """A new request's decoding options, as the scheduler resolved them at admission."""
    options = getattr(scheduler_output, "options", {}).get(req_id)
    if options is None:
        raise RuntimeError(f"request {req_id} reached the diffusion runner without decoding options: it runs "
                           "only under the diffusion scheduler (vllm_dllm.scheduler.scheduler.DiffusionScheduler)")
    return options


@dataclass
class DiffusionRunnerOutput(ModelRunnerOutput):
    """vLLM's runner output plus what the step cost (for the scheduler's metrics) and
    each request's progress, (block, step in block) of its next step (for its
    pricing: a parallel decoding rule ends a block when it has no masks left) and the
    tokens token editing rewrote."""

    logits_rows: int = 0
    progress: list[tuple[int, int]] = field(default_factory=list)
    edits: int = 0
    steps: int = 1  # denoising steps the call ran (a parallel rule's block end may cut it short)
    query_tokens: int = 0  # query tokens its forwards ran
    # ELBO estimates of the requests scored this step (engine/likelihood.py).
    likelihoods: dict[str, dict] = field(default_factory=dict)


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
        self.model_memory_usage = 0  # device bytes the weights took (CUDA; vLLM's memory profiling logs it)
        self.kv_caches: list[torch.Tensor] = []
        self.engine: StepEngine | None = None

    # ---- worker surface ----------------------------------------------------

    def load_model(self, load_dummy_weights: bool = False) -> None:
        if load_dummy_weights:
            raise ValueError("dummy weights are not supported by the diffusion runner")
        before = _device_memory_allocated(self.device)
        self.model = get_model(vllm_config=self.vllm_config)
        self.model_memory_usage = _device_memory_allocated(self.device) - before
        # The LM head's tile is the step's activation budget: wider FFN steps run in chunks.
        head_rows = self.model.output_head().num_embeddings_per_partition
        limit_activations(self.model, logits_tile_bytes(self.defaults.max_num_logits, head_rows))
        logger.info("Diffusion model loaded; special ids %s", special_ids(self.model_config, self.defaults.kind))
        self._build_engine()

    # Set when the start-up self-check finds the CUDA attention path wrong: the torch
    # backend without graphs from then on (engine rebuilds included).
    _torch_fallback = False
    # Set when the self-check finds whole-step graphs changing tokens: Reuse graphs alone.
    _step_graphs_off = False

    def _build_engine(self) -> None:
        self.engine = StepEngine(**self._engine_kwargs())

    def _engine_kwargs(self, backend=None) -> dict:
        if self._torch_fallback:
            backend = TorchAttention()
        return dict(
            model=self.model,
            kind=self.defaults.kind,
            ids=special_ids(self.model_config, self.defaults.kind),
            capacity=self.vllm_config.scheduler_config.max_num_seqs,
            max_model_len=self.model_config.max_model_len,
            block_size=self.block_size,
            max_num_logits=self.defaults.max_num_logits,
            backend=backend or select_backend(self.device, self.defaults.attention_backend),
            device=self.device,
            cuda_graphs=not self.model_config.enforce_eager and not self._torch_fallback,
            step_graphs=not self._step_graphs_off,
            graph_capture=self._graph_capture(),
            model_context=self._forward_context,
            prefill_chunk=prefill_chunk(self.vllm_config),
            max_logprobs=self.model_config.max_logprobs,
            lm_head=vocab_parallel_head(self.model.output_head(), getattr(self.model_config, "head_dtype", None)),
        )

    def self_check(self) -> None:
        """At warm-up, the KV pool bound: on CUDA the chosen attention backend, its
        graphs and the Triton Philox against their torch references
        (worker/self_check.py); on a CPU they are the references."""
        if self.device.type == "cuda" and self.kv_caches:
            self._self_check()

    def _self_check(self) -> None:
        from vllm_dllm.worker import self_check

        keep = self_check.run(
            self._engine_kwargs(backend=self.engine.backend), self.defaults, num_blocks=self.kv_caches[0].shape[0],
            vocab_size=self.model_config.get_vocab_size(), dtype=self.model_config.dtype,
        )
        if not keep:
            self._torch_fallback = True
            self._build_engine()
        elif self.engine.step_graphs is not None and not self_check.run_step_graphs(
            self._engine_kwargs(backend=self.engine.backend), self.defaults,
            num_blocks=self.kv_caches[0].shape[0], vocab_size=self.model_config.get_vocab_size(),
        ):
            self._step_graphs_off = True
            self._build_engine()

    def _forward_context(self, num_tokens: int):
        """vLLM's forward context around a forward: its fused MoE layers find
        themselves there (our attention reads its own metadata)."""
        return set_forward_context(None, self.vllm_config, num_tokens=num_tokens)

    def _graph_capture(self):
        """Under tensor parallelism a Reuse graph holds all-reduces: vLLM's custom
        all-reduce registers their buffers only inside its `graph_capture` context."""
        if self.device.type != "cuda" or self.vllm_config.parallel_config.tensor_parallel_size == 1:
            return None
        from vllm.distributed.parallel_state import graph_capture

        return functools.partial(capture_cuda_graph, capture_context=lambda: graph_capture(self.device))

    def get_model(self):
        return self.model

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def update_max_model_len(self, max_model_len: int) -> None:
        self.model_config.max_model_len = max_model_len
        if self.engine is not None:
            self._build_engine()  # before any request: its tensors are sized by the length

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        # vLLM turns chunked prefill and prefix caching off for non-causal layers;
        # block-causal K/V are prefix-stable by whole blocks, which the scheduler
        # respects (scheduler/prefix_cache.py, phases.block_causal_phase).
        non_causal = self.defaults.kind not in BLOCK_CAUSAL_KINDS
        return {
            layer.layer_name: FullAttentionSpec(
                block_size=self.block_size,
                num_kv_heads=layer.num_kv_heads,
                head_size=layer.head_dim,
                dtype=self.kv_cache_dtype,
                non_causal=non_causal,
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
        self.engine = None
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

    def profile_step(self) -> None:
        """A dummy step at the configured caps, so memory profiling sees the peak."""
        self.engine.profile_step(self.max_num_tokens)

    warming_up_model = profile_step

    # ---- one step ------------------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput, intermediate_tensors=None) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        self.engine.constrain(getattr(scheduler_output, "grammar", None))
        order = list(scheduler_output.num_scheduled_tokens)
        if not order:
            return EMPTY_MODEL_RUNNER_OUTPUT
        planned = [scheduler_output.num_scheduled_tokens[req_id] for req_id in order]
        result = self.engine.step(order, planned, steps=getattr(scheduler_output, "steps", 1))
        logprobs = None
        if result.logprobs is not None:
            logprobs = LogprobsLists(*result.logprobs, cu_num_generated_tokens=result.logprobs_start)
        return DiffusionRunnerOutput(
            **runner_output_order(order),
            sampled_token_ids=result.new_tokens,
            logprobs=logprobs,
            prompt_logprobs_dict={
                req_id: prompt_logprobs_tensors(arrays) for req_id, arrays in result.prompt_logprobs.items()
            },
            logits_rows=result.logits_rows,
            progress=result.progress,
            edits=result.edits,
            steps=result.steps,
            query_tokens=result.query_tokens,
            likelihoods=result.likelihoods,
        )

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        engine = self.engine
        for req_id in scheduler_output.finished_req_ids:
            engine.remove(req_id)
        for req_id in scheduler_output.preempted_req_ids or ():
            if req_id in engine:
                engine.drop_cache(req_id)
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in engine:
                # A resumed request keeps its canvas; only its KV blocks are new (a
                # block-causal one's prefix may come from the prefix cache).
                engine.resume(new.req_id, list(new.block_ids[0]), new.num_computed_tokens)
            else:
                self._add(new, new_request_options(scheduler_output, new.req_id))
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_blocks in zip(cached.req_ids, cached.new_block_ids):
            if new_blocks:
                engine.append_blocks(req_id, list(new_blocks[0]))

    def _add(self, new: NewRequestData, options: DecodeOptions) -> None:
        params = new.sampling_params
        seed = params.seed if params.seed is not None else unseeded_seed(new.req_id, self.model_config.seed)
        self.engine.add(new.req_id, list(new.prompt_token_ids), options, seed, list(new.block_ids[0]),
                        prefilled=new.num_computed_tokens, logprobs=params.logprobs,
                        prompt_logprobs=params.prompt_logprobs,
                        likelihood=elbo_task(self.defaults.kind, options, params.extra_args, seed),
                        stop_ids=stop_token_ids(params))
