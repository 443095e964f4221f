"""Every vLLM name the plugin relies on, for `python -m vllm_dllm.tools.vllm_surface_check`.

Pure data (no vLLM import): a release is judged by reading its source against this
list.  Derived from every `vllm` import and use in vllm_dllm/ and the entry-point
groups in pyproject.toml; tests/test_vllm_surface.py fails when plugin code imports
a vLLM name that is not listed here, or when a listed import is no longer used.

Kinds of expectation:
- NAMES: `from module import name` must still find the name (re-exports and vLLM's
  lazy `__getattr__` maps followed).
- OVERRIDES: methods we override, or that vLLM calls on our duck-typed objects with
  its own signature: parameter names, kinds and defaults must be exactly these.
- CALLS: functions and constructors we call: our arguments must still bind (new
  optional parameters are fine, a new required one or a renamed keyword is not).
- MEMBERS: attributes, methods and enum members we read or set on vLLM objects.
- CONSTRUCTED: dataclass-like classes we build with these fields: the fields must
  exist and no field without a default may be added.
- LITERALS: strings vLLM must still read where it did (entry-point groups, env vars).
- REVIEWED: functions whose *behaviour* our code depends on, with the code
  fingerprints of the versions we reviewed and how we handle each.  A new
  fingerprint is not a failure of the surface but a "look here" for a new release.
- RUNNER_CALLS: what vLLM's workers call on `self.model_runner` (our runner is not a
  vLLM class): each name is either provided by DiffusionModelRunner or known to be on
  a path our workers never take.

An expectation that holds only on some releases (compat.py branches on them) names
them in `versions`, a [low, high) range of (major, minor); a release outside it is
not checked against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

Versions = tuple[tuple[int, int], tuple[int, int]]
EVERY = ((0, 0), (99, 0))
# compat.V1_RUNNERS_REMOVED: vLLM's V1 runners, the V1/V2 switch and the V1
# logits-processor interface exist before 0.34; the V2 interface from 0.34 on.
BEFORE_034: Versions = ((0, 0), (0, 34))
FROM_034: Versions = ((0, 34), (99, 0))


def applies(item, version: tuple[int, int]) -> bool:
    low, high = getattr(item, "versions", EVERY)
    return low <= version < high


@dataclass(frozen=True)
class Name:
    module: str
    name: str
    why: str = ""
    versions: Versions = EVERY


@dataclass(frozen=True)
class Override:
    module: str
    qualname: str  # "Class.method"
    signature: str  # as printed by vllm_surface_check.signature_text
    why: str = ""
    versions: Versions = EVERY


@dataclass(frozen=True)
class Call:
    module: str
    qualname: str  # "function" or "Class.__init__" / "Class.method"
    positional: int  # positional arguments we pass (self/cls not counted)
    keywords: tuple[str, ...] = ()
    why: str = ""
    versions: Versions = EVERY


@dataclass(frozen=True)
class Members:
    module: str
    cls: str
    names: tuple[str, ...]
    why: str = ""
    versions: Versions = EVERY


@dataclass(frozen=True)
class Constructed:
    module: str
    cls: str
    fields: tuple[str, ...]
    why: str = ""
    versions: Versions = EVERY


@dataclass(frozen=True)
class Literal:
    module: str
    value: str
    why: str = ""
    versions: Versions = EVERY


@dataclass(frozen=True)
class Reviewed:
    module: str
    qualname: str
    fingerprints: dict[str, str]  # vLLM version -> code fingerprint reviewed
    note: str
    versions: Versions = EVERY


@dataclass(frozen=True)
class RunnerCalls:
    modules: tuple[str, ...]
    provided: frozenset[str]
    not_needed: dict[str, str] = field(default_factory=dict)


SCHED = "vllm.v1.core.sched.scheduler"
OUTPUT = "vllm.v1.core.sched.output"
KV = "vllm.v1.kv_cache_interface"
LAYERS = "vllm.model_executor.layers"

# ---- imports (module, name) exactly as the plugin writes them ---------------------

NAMES: tuple[Name, ...] = (
    Name("vllm", "ModelRegistry", "__init__.register"),
    Name("vllm", "__version__", "compat.vllm_version, when no distribution metadata is found"),
    Name("vllm", "_custom_ops", "models/cpu_rms_norm.py: loads torch.ops._C (rms_norm, fused_add_rms_norm) on the CPU"),
    Name("vllm", "ir", "models/cpu_rms_norm.py: registers the CPU RMSNorm provider"),
    Name("vllm.config", "VllmConfig", "models/, worker/runner.py"),
    Name("vllm.distributed", "get_tensor_model_parallel_world_size", "models/transformer.py"),
    Name("vllm.distributed", "tensor_model_parallel_all_gather",
         "worker/vocab_parallel.py: the LM head's per-row numbers"),
    Name("vllm.exceptions", "VLLMValidationError", "validation.py"),
    Name("vllm.sampling_params", "RequestOutputKind", "validation.py: a likelihood is not streamed"),
    Name("vllm.exceptions", "VLLMClientError", "frontend.py: a refused stream's exception, logged as one line"),
    Name("vllm.forward_context", "set_forward_context", "worker/runner.py: fused MoE layers look themselves up there"),
    Name("vllm.logger", "init_logger", "scheduler, server_config, runner"),
    Name(f"{LAYERS}.activation", "SiluAndMul", "models/transformer.py"),
    Name(f"{LAYERS}.fused_moe", "FusedMoEFactory", "models/moe.py"),
    Name(f"{LAYERS}.layernorm", "RMSNorm", "models/transformer.py"),
    Name(f"{LAYERS}.linear", "MergedColumnParallelLinear", "models/transformer.py"),
    Name(f"{LAYERS}.linear", "QKVParallelLinear", "models/transformer.py"),
    Name(f"{LAYERS}.linear", "RowParallelLinear", "models/transformer.py"),
    Name(f"{LAYERS}.logits_processor", "LogitsProcessor", "models/transformer.py"),
    Name(f"{LAYERS}.rotary_embedding", "get_rope", "models/rope.py"),
    Name(f"{LAYERS}.vocab_parallel_embedding", "ParallelLMHead", "models/transformer.py"),
    Name(f"{LAYERS}.vocab_parallel_embedding", "VocabParallelEmbedding", "models/transformer.py"),
    Name("vllm.model_executor.model_loader", "get_model", "worker/runner.py"),
    Name("vllm.model_executor.model_loader.weight_utils", "default_weight_loader", "models/weights.py"),
    Name("vllm.model_executor.models.config", "MODELS_CONFIG_MAP", "compat.register_config_hook: private hook"),
    Name("vllm.platforms", "current_platform", "server_config"),
    Name("vllm.platforms", "CpuArchEnum", "models/cpu_rms_norm.py: bfloat16 only from the x86 AVX-512-BF16 build"),
    Name("vllm.transformers_utils.repo_utils", "get_hf_file_to_dict", "server_config"),
    Name("vllm.utils.math_utils", "cdiv", "scheduler"),
    Name("vllm.utils.torch_utils", "kv_cache_dtype_str_to_dtype", "worker/runner.py"),
    Name(OUTPUT, "CachedRequestData", "compat.cached_request_data"),
    Name(OUTPUT, "NewRequestData", "compat.new_request_data, scheduler, runner"),
    Name("vllm.v1.core.kv_cache_manager", "KVCacheBlocks", "scheduler/prefix_cache.py"),
    Name(OUTPUT, "SchedulerOutput", "scheduler, runner"),
    Name("vllm.v1.core.sched.request_queue", "SchedulingPolicy", "scheduler"),
    Name(SCHED, "Scheduler", "scheduler: subclassed"),
    Name("vllm.v1.engine", "EngineCoreEventType", "scheduler"),
    Name("vllm.v1.engine", "EngineCoreOutput", "scheduler"),
    Name("vllm.v1.engine", "EngineCoreOutputs", "scheduler"),
    Name(KV, "FullAttentionSpec", "runner"),
    Name(KV, "KVCacheConfig", "runner, kv_pool"),
    Name(KV, "KVCacheSpec", "runner"),
    Name("vllm.v1.metrics.loggers", "StatLoggerBase", "metrics: subclassed"),
    Name("vllm.v1.outputs", "EMPTY_MODEL_RUNNER_OUTPUT", "runner"),
    Name("vllm.v1.outputs", "ModelRunnerOutput", "runner: subclassed"),
    Name("vllm.v1.outputs", "LogprobsLists", "runner: committed tokens' logprob rows"),
    Name("vllm.v1.outputs", "LogprobsTensors", "runner: prompt logprob rows"),
    Name("vllm.v1.request", "Request", "scheduler"),
    Name("vllm.v1.request", "RequestStatus", "scheduler"),
    Name("vllm.v1.sample.logits_processor.interface", "LogitsProcessor",
         "compat.logits_processor_base: validation subclasses it", versions=BEFORE_034),
    Name("vllm.v1.worker.gpu.sample.logits_processor.interface", "LogitsProcessor",
         "compat.logits_processor_base: validation subclasses it", versions=FROM_034),
    Name("vllm.v1.spec_decode.metrics", "SpecDecodingStats", "metrics"),
    Name("vllm.v1.worker.cpu_worker", "CPUWorker", "worker: subclassed"),
    Name("vllm.v1.worker.gpu_worker", "Worker", "worker: subclassed"),
    Name("vllm.v1.worker.gpu_worker", "init_worker_distributed_environment", "compat.init_cpu_worker_device",
         versions=FROM_034),
    Name("vllm.utils.torch_utils", "set_random_seed", "compat.init_cpu_worker_device", versions=FROM_034),
    Name("vllm.v1.worker.worker_base", "CompilationTimes", "worker/gpu_worker.py"),
    Name("vllm.utils.mem_utils", "memory_profiling", "worker/gpu_worker.py"),
    Name("vllm.distributed.parallel_state", "graph_capture", "worker/runner.py: Reuse graphs under TP"),
    Name("vllm.config.compilation", "CompilationMode", "compat.keep_vllm_compilation_off"),
    Name("vllm.config.compilation", "CUDAGraphMode", "compat.keep_vllm_compilation_off"),
    Name("vllm.vllm_flash_attn", "flash_attn_varlen_func", "attention/backends.py (CUDA only)"),
    Name("vllm.vllm_flash_attn", "fa_version_unsupported_reason", "attention/backends.py (CUDA only)"),
    # Named as strings, not imported.
    Name(SCHED, "Scheduler", "server_config: the default scheduler_cls value we replace"),
)

# ---- overridden methods and the hooks vLLM calls on our objects -------------------

_RUNNER = "vllm.v1.worker.gpu_model_runner"
_V2_LOGITS = "vllm.v1.worker.gpu.sample.logits_processor.interface"
_V2_RUNNER = "vllm.v1.worker.gpu.model_runner"
OVERRIDES: tuple[Override, ...] = (
    Override(SCHED, "Scheduler.add_request", "(self, request)"),
    Override(SCHED, "Scheduler._preempt_request", "(self, request, timestamp, drop_stale_output=False)"),
    Override(SCHED, "Scheduler.schedule", "(self, throttle_prefills=False)"),
    Override(SCHED, "Scheduler.update_from_output", "(self, scheduler_output, model_runner_output)"),
    Override(
        SCHED,
        "Scheduler.make_stats",
        "(self, spec_decoding_stats=None, kv_connector_stats=None, cudagraph_stats=None, "
        "perf_stats=None, ec_connector_stats=None)",
        "we pass spec_decoding_stats and forward the rest",
    ),
    Override("vllm.v1.metrics.loggers", "StatLoggerBase.__init__", "(self, vllm_config, engine_index=0)"),
    Override(
        "vllm.v1.metrics.loggers",
        "StatLoggerBase.record",
        "(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0)",
    ),
    Override("vllm.v1.metrics.loggers", "StatLoggerBase.log_engine_initialized", "(self)"),
    Override("vllm.v1.worker.cpu_worker", "CPUWorker.init_device", "(self)", "we swap the runner after it"),
    Override("vllm.v1.worker.gpu_worker", "Worker._make_model_runner", "(self)"),
    Override("vllm.v1.worker.gpu_worker", "Worker.determine_available_memory", "(self)"),
    Override("vllm.v1.worker.gpu_worker", "Worker.compile_or_warm_up_model", "(self)"),
    Override(
        "vllm.model_executor.models.config",
        "VerifyAndUpdateConfig.verify_and_update_model_config",
        "@staticmethod (model_config)",
        "the MODELS_CONFIG_MAP hook protocol",
    ),
    Override(
        "vllm.model_executor.models.config",
        "VerifyAndUpdateConfig.verify_and_update_config",
        "@staticmethod (vllm_config)",
        "the MODELS_CONFIG_MAP hook protocol",
    ),
    Override(
        "vllm.v1.sample.logits_processor.interface",
        "LogitsProcessor.validate_params",
        "@classmethod (cls, sampling_params)", versions=BEFORE_034),
    Override(
        "vllm.v1.sample.logits_processor.interface",
        "LogitsProcessor.__init__",
        "(self, vllm_config, device, is_pin_memory)", versions=BEFORE_034),
    Override("vllm.v1.sample.logits_processor.interface", "LogitsProcessor.apply", "(self, logits)", versions=BEFORE_034),
    Override(_V2_LOGITS, "LogitsProcessor.validate_params", "@classmethod (cls, sampling_params)",
             versions=FROM_034),
    Override(_V2_LOGITS, "LogitsProcessor.__init__", "(self, vllm_config, req_states)",
             "validation takes (vllm_config, *args): V1's device and pinning, V2's request state", versions=FROM_034),
    Override(_V2_LOGITS, "LogitsProcessor.apply", "(self, logits, ctx)",
             "validation takes (logits, *context): V2 adds the step's context", versions=FROM_034),
    Override("vllm.plugins.endpoint_plugins.interface", "EndpointPlugin.attach_router", "(self, app)",
             "frontend.DiffusionEndpoints (a Protocol, not subclassed)"),
    Override("vllm.plugins.endpoint_plugins.interface", "EndpointPlugin.init_state",
             "(self, engine_client, state, args)", "frontend.DiffusionEndpoints"),
    Override("vllm.v1.sample.logits_processor.interface", "LogitsProcessor.is_argmax_invariant", "(self)", versions=BEFORE_034),
    Override("vllm.v1.sample.logits_processor.interface", "LogitsProcessor.update_state", "(self, batch_update)", versions=BEFORE_034),
    # DiffusionModelRunner mirrors vLLM's V1 runner: the workers call these with its signatures.
    Override(_RUNNER, "GPUModelRunner.load_model", "(self, load_dummy_weights=False, *, model=None)",
             "ours takes load_dummy_weights; model= is passed only by weight reloading", versions=BEFORE_034),
    Override(_RUNNER, "GPUModelRunner.execute_model", "(self, scheduler_output, intermediate_tensors=None)", versions=BEFORE_034),
    Override(_RUNNER, "GPUModelRunner.sample_tokens", "(self, grammar_output)", versions=BEFORE_034),
    Override(
        _RUNNER,
        "GPUModelRunner.initialize_kv_cache",
        "(self, kv_cache_config, is_profiling=False, kv_cache_allocation_context=None)",
        versions=BEFORE_034,
    ),
    Override(_RUNNER, "GPUModelRunner.get_kv_cache_spec", "(self)", versions=BEFORE_034),
    Override(_RUNNER, "GPUModelRunner.update_max_model_len", "(self, max_model_len)", versions=BEFORE_034),
    Override(_RUNNER, "GPUModelRunner.take_draft_token_ids", "(self)", versions=BEFORE_034),
    Override(_RUNNER, "GPUModelRunner.get_supported_tasks", "(self)", versions=BEFORE_034),
    Override(_RUNNER, "GPUModelRunner.maybe_remove_all_loras", "(self, lora_config)", versions=BEFORE_034),
    Override(_RUNNER, "GPUModelRunner.shutdown", "(self)", versions=BEFORE_034),
    Override(_RUNNER, "GPUModelRunner.reset_mm_cache", "(self)", versions=BEFORE_034),
    Override(_RUNNER, "GPUModelRunner.reset_encoder_cache", "(self)", versions=BEFORE_034),
    Override(_RUNNER, "GPUModelRunner.get_model", "(self)", versions=BEFORE_034),
    Override(_RUNNER, "GPUModelRunner.get_draft_model", "(self)", versions=BEFORE_034),
    Override(_RUNNER, "GPUModelRunner.get_encoder_timing_stats", "(self)", versions=BEFORE_034),
    # From 0.34 the workers build (and call with the signatures of) the V2 runner.
    Override(_V2_RUNNER, "GPUModelRunner.load_model",
             "(self, load_dummy_weights=False, *args, model=None, **kwargs)", "ours takes load_dummy_weights; model= is passed only by weight reloading", versions=FROM_034),
    Override(_V2_RUNNER, "GPUModelRunner.execute_model",
             "(self, scheduler_output, intermediate_tensors=None, dummy_run=False, skip_attn_for_dummy_run=False, is_profile=False, context_len=0, valid_dummy_state_slots=False, randomize_inputs=False)", "the workers pass the first two; the rest only on dummy/profile runs of vLLM's own", versions=FROM_034),
    Override(_V2_RUNNER, "GPUModelRunner.sample_tokens",
             "(self, grammar_output)", versions=FROM_034),
    Override(_V2_RUNNER, "GPUModelRunner.initialize_kv_cache",
             "(self, kv_cache_config, is_profiling=False, kv_cache_allocation_context=None, extensible=False)", "extensible= only with the extensible KV cache, which compat.keep_vllm_runner_warmups_off turns off", versions=FROM_034),
    Override(_V2_RUNNER, "GPUModelRunner.get_kv_cache_spec", "(self)", versions=FROM_034),
    Override(_V2_RUNNER, "GPUModelRunner.update_max_model_len", "(self, max_model_len)", versions=FROM_034),
    Override(_V2_RUNNER, "GPUModelRunner.take_draft_token_ids", "(self)", versions=FROM_034),
    Override(_V2_RUNNER, "GPUModelRunner.get_supported_tasks", "(self)", versions=FROM_034),
    Override(_V2_RUNNER, "GPUModelRunner.maybe_remove_all_loras", "(self, lora_config)", versions=FROM_034),
    Override(_V2_RUNNER, "GPUModelRunner.shutdown", "(self)", versions=FROM_034),
    Override(_V2_RUNNER, "GPUModelRunner.reset_mm_cache", "(self)", versions=FROM_034),
    Override(_V2_RUNNER, "GPUModelRunner.reset_encoder_cache", "(self)", versions=FROM_034),
    Override(_V2_RUNNER, "GPUModelRunner.get_model", "(self)", versions=FROM_034),
    Override(_V2_RUNNER, "GPUModelRunner.get_draft_model", "(self)", versions=FROM_034),
    Override(_V2_RUNNER, "GPUModelRunner.get_encoder_timing_stats", "(self)", versions=FROM_034),
    Override("vllm.v1.worker.cpu_model_runner", "CPUModelRunner.warming_up_model", "(self)",
             "CPUWorker.compile_or_warm_up_model calls it; ours runs a profile step", versions=BEFORE_034),
    Override("vllm.v1.worker.cpu.model_runner", "CPUModelRunner.warming_up_model", "(self)",
             "CPUWorker.determine_available_memory calls it; ours runs a profile step", versions=FROM_034),
)

# ---- calls ----------------------------------------------------------------------------

CALLS: tuple[Call, ...] = (
    Call("vllm.logger", "init_logger", 1),
    Call("vllm.v1.worker.gpu_worker", "init_worker_distributed_environment", 5, (), "compat.init_cpu_worker_device",
         versions=FROM_034),
    Call("vllm.utils.torch_utils", "set_random_seed", 1, (), "compat.init_cpu_worker_device", versions=FROM_034),
    Call("vllm.ir.op", "IrOp.register_impl", 1, ("supports_args", "supported", "inplace"),
         "models/cpu_rms_norm.py"),
    Call("vllm.utils.math_utils", "cdiv", 2),
    Call("vllm.model_executor.model_loader", "get_model", 0, ("vllm_config",)),
    Call("vllm.utils.torch_utils", "kv_cache_dtype_str_to_dtype", 2),
    Call("vllm.utils.mem_utils", "memory_profiling", 1, ("weights_memory",)),
    Call("vllm.distributed.parallel_state", "graph_capture", 1),
    Call("vllm.model_executor.model_loader.weight_utils", "default_weight_loader", 2),
    Call("vllm.transformers_utils.repo_utils", "get_hf_file_to_dict", 3),
    Call("vllm.distributed", "get_tensor_model_parallel_world_size", 0),
    Call("vllm.distributed", "tensor_model_parallel_all_gather", 1, ("dim",)),
    Call(f"{LAYERS}.vocab_parallel_embedding", "UnquantizedEmbeddingMethod.apply", 2, ("bias",),
         "worker/vocab_parallel.py: a rank's vocabulary columns, as LogitsProcessor projects them"),
    Call("vllm.forward_context", "set_forward_context", 2, ("num_tokens",)),
    Call(f"{LAYERS}.rotary_embedding", "get_rope", 1, ("max_position", "is_neox_style", "rope_parameters")),
    Call(
        f"{LAYERS}.linear",
        "QKVParallelLinear.__init__",
        0,
        ("hidden_size", "head_size", "total_num_heads", "total_num_kv_heads", "bias", "quant_config", "prefix"),
    ),
    Call(f"{LAYERS}.linear", "RowParallelLinear.__init__", 0,
         ("input_size", "output_size", "bias", "quant_config", "prefix")),
    Call(f"{LAYERS}.linear", "MergedColumnParallelLinear.__init__", 0,
         ("input_size", "output_sizes", "bias", "quant_config", "prefix")),
    Call(f"{LAYERS}.layernorm", "RMSNorm.__init__", 1, ("eps",)),
    Call(f"{LAYERS}.activation", "SiluAndMul.__init__", 0),
    Call(f"{LAYERS}.fused_moe", "FusedMoEFactory", 0,
         ("num_experts", "top_k", "hidden_size", "intermediate_size", "renormalize", "use_grouped_topk",
          "num_expert_group", "topk_group", "quant_config", "prefix", "scoring_func", "routed_scaling_factor",
          "e_score_correction_bias", "router_logits_dtype", "custom_routing_function"),
         "models/moe.py; models/llada_moe.py: custom_routing_function is called with the keywords "
         "hidden_states, gating_output, topk, renormalize and returns (weights, ids)"),
    Call(f"{LAYERS}.fused_moe.routed_experts", "RoutedExperts.weight_loader", 3, ("shard_id", "expert_id", "return_success"),
         "models/moe.py: a checkpoint's per-expert projection into the fused w13/w2"),
    Call(f"{LAYERS}.vocab_parallel_embedding", "ParallelLMHead.__init__", 2, ("quant_config",)),
    Call(f"{LAYERS}.vocab_parallel_embedding", "VocabParallelEmbedding.__init__", 2),
    Call(f"{LAYERS}.logits_processor", "LogitsProcessor.__init__", 1),
    Call(f"{LAYERS}.logits_processor", "LogitsProcessor.forward", 2, (), "called as logits_processor(lm_head, rows)"),
    Call("vllm.model_executor.models.registry", "_ModelRegistry.register_model", 2, (), "vllm.ModelRegistry"),
    Call("vllm.model_executor.models.registry", "_ModelRegistry.get_supported_archs", 0),
    Call("vllm.exceptions", "VLLMValidationError.__init__", 1, ("parameter",)),
    Call(SCHED, "Scheduler.finish_requests", 2),
    Call("vllm.v1.core.kv_cache_manager", "KVCacheManager.allocate_slots", 2,
         ("num_new_computed_tokens", "new_computed_blocks", "has_scheduled_reqs", "delay_cache_blocks")),
    Call("vllm.v1.core.kv_cache_manager", "KVCacheManager.cache_blocks", 2, (),
         "scheduler: a block-causal request's final K/V enter the prefix cache as they are written"),
    Call("vllm.v1.core.kv_cache_manager", "KVCacheManager.get_computed_blocks", 1, (),
         "scheduler: reads [0] blocks and [1] hit tokens of the returned tuple"),
    Call("vllm.v1.core.kv_cache_manager", "KVCacheManager.record_prefix_cache_stats", 2),
    Call("vllm.v1.core.kv_cache_manager", "KVCacheManager.get_blocks", 1),
    Call("vllm.v1.core.kv_cache_manager", "KVCacheBlocks.get_block_ids", 0),
    Call("vllm.v1.core.block_pool", "BlockPool.get_num_free_blocks", 0),
    Call("vllm.v1.core.sched.request_queue", "RequestQueue.remove_request", 1),
    Call(OUTPUT, "NewRequestData.from_request", 2, (), "compat.new_request_data", versions=BEFORE_034),
    Call(OUTPUT, "NewRequestData.from_request", 3, (), "compat.new_request_data: with prefill_token_ids",
         versions=FROM_034),
    Call("vllm.v1.request", "Request.record_event", 2),
    Call("vllm.v1.request", "Request.take_events", 0),
    Call("vllm.v1.request", "Request.get_finished_reason", 0),
    Call("vllm.v1.request", "Request.is_finished", 0, (), "scheduler/accounting.py"),
)

# ---- attributes read or set ------------------------------------------------------------

MEMBERS: tuple[Members, ...] = (
    Members(
        SCHED,
        "Scheduler",
        (
            "vllm_config", "cache_config", "kv_cache_manager", "requests", "running", "waiting", "policy",
            "max_num_scheduled_tokens", "max_num_running_reqs", "max_model_len", "log_stats",
            "finished_req_ids", "reset_preempted_req_ids", "deferred_waiting", "structured_output_manager",
            "grammar_compile_error_reqs",
        ),
        "scheduler reads (and resets finished_req_ids and reset_preempted_req_ids, and discards "
        "admitted requests from deferred_waiting) as vLLM's own schedule() does",
    ),
    Members("vllm.v1.core.kv_cache_manager", "KVCacheManager", ("block_pool", "enable_caching")),
    # Structured outputs (scheduler/grammar.py, scheduler.py): the grammar objects are
    # driven directly, the manager only lends its tokenizer and bitmask allocator.
    Members("vllm.v1.structured_output", "StructuredOutputManager", ("tokenizer", "backend")),
    Members("vllm.v1.structured_output.backend_types", "StructuredOutputGrammar",
            ("accept_tokens", "validate_tokens", "rollback", "fill_bitmask", "is_terminated")),
    Members("vllm.v1.structured_output.backend_types", "StructuredOutputBackend", ("allocate_token_bitmask",)),
    Members("vllm.v1.structured_output.request", "StructuredOutputRequest", ("grammar",)),
    Members("vllm.config.structured_outputs", "StructuredOutputsConfig", ("backend", "disable_any_whitespace"),
            "server_config._compact_json: compact JSON by default"),
    Members("vllm.v1.request", "Request", ("use_structured_output", "structured_output_request")),
    Members("vllm.v1.request", "RequestStatus", ("WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR", "WAITING")),
    Members("vllm.ir.op", "IrOp", ("register_impl", "impls"), "models/cpu_rms_norm.py: the CPU RMSNorm provider"),
    Members("vllm.platforms.interface", "CpuArchEnum", ("X86",), "models/cpu_rms_norm.py"),
    Members("vllm.config.kernel", "IrOpPriorityConfig", ("rms_norm", "fused_add_rms_norm"),
            "models/cpu_rms_norm.prefer_on_cpu: the provider first unless the user set these"),
    Members("vllm.config.kernel", "KernelConfig", ("ir_op_priority",), "server_config: the CPU RMSNorm provider"),
    Members("vllm.v1.core.block_pool", "BlockPool", ("num_gpu_blocks",)),
    Members(
        "vllm.v1.request",
        "Request",
        (
            "request_id", "sampling_params", "num_prompt_tokens", "priority", "arrival_time", "status",
            "client_index", "num_computed_tokens", "num_output_tokens", "num_in_flight_tokens", "num_tokens",
        ),
    ),
    Members("vllm.v1.request", "Request", ("prefill_token_ids",), "compat.new_request_data", versions=FROM_034),
    Members("vllm.v1.request", "RequestStatus", ("RUNNING", "FINISHED_ERROR")),
    Members("vllm.v1.core.sched.request_queue", "SchedulingPolicy", ("PRIORITY",)),
    Members("vllm.v1.engine", "EngineCoreEventType", ("SCHEDULED",)),
    Members("vllm.v1.engine", "EngineCoreOutputs", ("outputs",)),
    Members("vllm.v1.metrics.stats", "SchedulerStats", ("spec_decoding_stats",), "make_stats result"),
    Members(
        "vllm.sampling_params",
        "SamplingParams",
        (
            "max_tokens", "temperature", "top_p", "top_k", "extra_args", "seed", "logit_bias", "logprobs",
            "prompt_logprobs", "structured_outputs", "allowed_token_ids", "bad_words", "min_p",
            "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "output_kind", "n",
            "all_stop_token_ids", "ignore_eos",
        ),
        "options.resolve, validation, runner",
    ),
    Members("vllm.sampling_params", "RequestOutputKind", ("FINAL_ONLY",), "validation: likelihood"),
    Members("vllm.v1.engine", "EngineCoreOutput", ("request_id", "finish_reason", "kv_transfer_params"),
            "scheduler: a request's ELBO rides its final output to the response"),
    Members(
        OUTPUT,
        "SchedulerOutput",
        ("finished_req_ids", "preempted_req_ids", "scheduled_new_reqs", "scheduled_cached_reqs",
         "num_scheduled_tokens", "total_num_scheduled_tokens"),
    ),
    Members(OUTPUT, "NewRequestData",
            ("req_id", "block_ids", "sampling_params", "prompt_token_ids", "num_computed_tokens")),
    Members(OUTPUT, "CachedRequestData", ("req_ids", "new_block_ids")),
    Members("vllm.v1.outputs", "ModelRunnerOutput", ("sampled_token_ids", "req_ids"), "compat.output_rows"),
    Members("vllm.v1.outputs", "ModelRunnerOutput", ("req_id_to_index",), "compat.runner_output_order",
            versions=BEFORE_034),
    Members(KV, "KVCacheConfig", ("num_blocks", "kv_cache_tensors", "kv_cache_groups")),
    Members(KV, "KVCacheTensor", ("size", "layers", "offset", "layer_stride", "block_stride")),
    Members(KV, "KVCacheGroupSpec", ("kv_cache_spec", "layer_names")),
    Members(KV, "FullAttentionSpec", ("page_size_bytes",)),
    Members(
        "vllm.config.vllm",
        "VllmConfig",
        ("model_config", "cache_config", "parallel_config", "scheduler_config", "additional_config",
         "quant_config", "compilation_config", "lora_config", "speculative_config", "kv_transfer_config",
         "kernel_config"),
    ),
    Members("vllm.config.vllm", "VllmConfig", ("use_v2_model_runner",), versions=BEFORE_034),
    Members("vllm.config.kernel", "KernelConfig", ("enable_jit_warmup",), "compat.keep_vllm_runner_warmups_off",
            versions=FROM_034),
    Members("vllm.config.cache", "CacheConfig", ("enable_extensible_kv_cache",),
            "compat.keep_vllm_runner_warmups_off", versions=FROM_034),
    Members(
        "vllm.config.model",
        "ModelConfig",
        ("hf_config", "model", "revision", "seed", "max_model_len", "served_model_name",
         "override_generation_config", "logits_processors", "tokenizer", "tokenizer_revision",
         "trust_remote_code", "get_diff_sampling_param", "max_logprobs", "logprobs_mode",
         "get_total_num_kv_heads", "head_dtype", "enable_prompt_embeds"),
    ),
    Members(f"{LAYERS}.rotary_embedding.base", "RotaryEmbedding", ("rotary_dim", "forward_native"),
            "models/rope.py: the native rotation where the CPU kernel cannot take the width"),
    Members(f"{LAYERS}.vocab_parallel_embedding", "VocabParallelEmbedding",
            ("quant_method", "shard_indices", "tp_size", "tp_rank", "org_vocab_size"), "worker/vocab_parallel.py"),
    Members(f"{LAYERS}.vocab_parallel_embedding", "VocabParallelEmbeddingShardIndices",
            ("org_vocab_start_index", "org_vocab_end_index", "num_org_elements"), "worker/vocab_parallel.py"),
    Members("vllm.config.cache", "CacheConfig",
            ("block_size", "user_specified_block_size", "cache_dtype", "enable_prefix_caching",
             "gpu_memory_utilization", "kv_cache_memory_bytes")),
    Members("vllm.config.compilation", "CompilationConfig", ("mode", "cudagraph_mode")),
    Members("vllm.config.compilation", "CompilationMode", ("NONE",)),
    Members("vllm.config.compilation", "CUDAGraphMode", ("NONE",)),
    Members("vllm.utils.mem_utils", "MemoryProfilingResult", ("non_kv_cache_memory",)),
    Members("vllm.config.parallel", "ParallelConfig", ("pipeline_parallel_size", "worker_cls", "tensor_parallel_size")),
    Members("vllm.config.scheduler", "SchedulerConfig",
            ("scheduler_cls", "async_scheduling", "max_num_batched_tokens", "max_num_seqs",
             "enable_chunked_prefill", "long_prefill_token_threshold")),
    Members("vllm.platforms.interface", "Platform", ("is_cpu", "is_cuda", "device_name", "get_cpu_architecture")),
    Members("vllm.v1.worker.gpu_worker", "Worker",
            ("vllm_config", "model_runner", "device", "cache_config", "init_snapshot", "requested_memory")),
    Members("vllm.v1.worker.cpu_worker", "CPUWorker", ("vllm_config", "model_runner")),
    Members("vllm.v1.worker.cpu_worker", "CPUWorker",
            ("device", "distributed_init_method", "rank", "local_rank", "model_config"),
            "compat.init_cpu_worker_device", versions=FROM_034),
    Members("vllm.platforms.interface", "Platform", ("dist_backend",), "compat.init_cpu_worker_device",
            versions=FROM_034),
    Members("vllm.plugins.endpoint_plugins.interface", "EndpointPlugin", ("name", "required_tasks"), "frontend"),
    Members("vllm.engine.protocol", "EngineClient", ("model_config",), "frontend"),
)

# ---- classes we construct -------------------------------------------------------------------

CONSTRUCTED: tuple[Constructed, ...] = (
    Constructed(OUTPUT, "CachedRequestData",
                ("req_ids", "resumed_req_ids", "new_token_ids", "all_token_ids", "new_block_ids",
                 "num_computed_tokens", "num_output_tokens"), "compat.cached_request_data", versions=BEFORE_034),
    Constructed(OUTPUT, "CachedRequestData",
                ("req_ids", "new_token_ids", "new_block_ids", "num_computed_tokens", "num_output_tokens"),
                "compat.cached_request_data", versions=FROM_034),
    Constructed(OUTPUT, "SchedulerOutput",
                ("scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens",
                 "total_num_scheduled_tokens", "scheduled_spec_decode_tokens", "scheduled_encoder_inputs",
                 "finished_req_ids", "free_encoder_mm_hashes", "preempted_req_ids")),
    Constructed("vllm.v1.engine", "EngineCoreOutput",
                ("request_id", "new_token_ids", "finish_reason", "stop_reason", "events")),
    Constructed("vllm.v1.engine", "EngineCoreOutputs", ()),
    Constructed("vllm.v1.outputs", "ModelRunnerOutput",
                ("req_ids", "req_id_to_index", "sampled_token_ids", "logprobs", "prompt_logprobs_dict"),
                "DiffusionRunnerOutput subclasses it", versions=BEFORE_034),
    Constructed("vllm.v1.outputs", "ModelRunnerOutput",
                ("req_ids", "sampled_token_ids", "logprobs", "prompt_logprobs_dict"),
                "DiffusionRunnerOutput subclasses it", versions=FROM_034),
    Constructed("vllm.v1.outputs", "LogprobsTensors", ("logprob_token_ids", "logprobs", "selected_token_ranks"),
                "runner: built positionally; vLLM sends a request's rows with its first output tokens"),
    Constructed("vllm.v1.outputs", "LogprobsLists",
                ("logprob_token_ids", "logprobs", "sampled_token_ranks", "cu_num_generated_tokens"),
                "runner: built positionally in this field order; vLLM slices a request's rows by cu_num_generated_tokens"),
    Constructed("vllm.v1.spec_decode.metrics", "SpecDecodingStats",
                ("num_spec_tokens", "num_drafts", "num_draft_tokens", "num_accepted_tokens",
                 "num_accepted_tokens_per_pos", "num_draft_tokens_per_pos")),
    Constructed("vllm.v1.core.kv_cache_manager", "KVCacheBlocks", ("blocks",), "scheduler/prefix_cache.py"),
    Constructed(KV, "FullAttentionSpec", ("block_size", "num_kv_heads", "head_size", "dtype", "non_causal")),
    Constructed("vllm.v1.worker.worker_base", "CompilationTimes", ("language_model", "encoder")),
)

# ---- strings vLLM reads -------------------------------------------------------------------------

LITERALS: tuple[Literal, ...] = (
    Literal("vllm.plugins", "vllm.general_plugins", "pyproject entry point dllm = vllm_dllm:register"),
    Literal("vllm.plugins", "vllm.stat_logger_plugins",
            "pyproject entry point dllm = vllm_dllm.serving.metrics:DiffusionStatLogger"),
    Literal("vllm.plugins", "vllm.endpoint_plugins",
            "pyproject entry point dllm = vllm_dllm.serving.frontend:DiffusionEndpoints"),
    Literal("vllm.v1.sample.logits_processor", "vllm.logits_processors",
            "server_config warns that installed logits-processor plugins are not applied", versions=BEFORE_034),
    Literal("vllm.v1.worker.gpu.sample.logits_processor.loader", "vllm.logits_processors",
            "server_config warns that installed logits-processor plugins are not applied", versions=FROM_034),
    Literal("vllm.envs", "VLLM_USE_V2_MODEL_RUNNER", "compat.keep_v1_model_runner keeps the V2 runner off",
            versions=BEFORE_034),
    Literal("vllm.v1.worker.cpu_worker", "VLLM_DIST_IDENT",
            "compat.init_cpu_worker_device sets it as CPUWorker.init_device does", versions=FROM_034),
    Literal("vllm.distributed.device_communicators.cpu_communicator", "VLLM_DIST_IDENT",
            "vLLM's CPU communicator reads what compat.init_cpu_worker_device sets", versions=FROM_034),
    Literal("vllm.envs", "VLLM_CPU_NUM_OF_RESERVED_CPU",
            "server_config gives the CPU worker every core of a small machine"),
)

# ---- behaviour reviewed, per version -----------------------------------------------------------

REVIEWED: tuple[Reviewed, ...] = (
    Reviewed(
        SCHED, "Scheduler._update_request_with_output",
        {"0.32": "ffcaec8de983", "0.33": "d7f0ff1e416d"},
        "0.33 subtracts the tokens trimmed at a stop from num_computed_tokens, 0.32 does not: "
        "compat.stop_trims_computed_tokens + scheduler/accounting.py keep the counter at "
        "num_tokens - 1 under both",
    ),
    Reviewed(
        SCHED, "Scheduler.update_from_output",
        {"0.32": "d285784b0bfe", "0.33": "277436550f4f", "0.34": "03ac75b9a1ad"},
        "wrapped by DiffusionScheduler (metrics, rejections) and ComputedTokensAccounting; 0.33 "
        "adds the stop trim (above), deferred KV frees/loads and re-queued resumable requests "
        "(KV connectors and streaming sessions only, not used with diffusion models); 0.34 finds "
        "a request's row by its position in req_ids (compat.runner_output_order, compat.output_rows) "
        "and adds Mamba prefix caching and watermarking reports (neither applies to our models)",
    ),
    Reviewed(
        SCHED, "Scheduler.schedule",
        {"0.32": "6625adf8f31b", "0.33": "e772cd227475", "0.34": "11d053fe9bab"},
        "replaced by DiffusionScheduler.schedule, never called: a change may mean state or "
        "SchedulerOutput fields we do not set; 0.33 adds a prefill cadence, draft skipping, "
        "deferred KV loads and the fields encoder_input_updates / skip_drafts, whose defaults "
        "(no encoder inputs, no drafts) are right for us; 0.34 sends resumed requests as new "
        "ones with their prefill token ids (compat.new_request_data; ours already re-sends a "
        "resumed request in full), drops the V1 prev-step bookkeeping, and adds an async-KV-load "
        "queue and parked reservations (KV connectors only, refused for our models); every "
        "version discards an admitted request from deferred_waiting, as ours does",
    ),
    Reviewed(
        SCHED, "Scheduler._preempt_request",
        {"0.32": "9818eae20ab5", "0.33": "d7c9e7fc2ffc"},
        "wrapped: we mark the request's cache stale, then call it; 0.33 also drops pending "
        "encoder inputs (none for us)",
    ),
    Reviewed(SCHED, "Scheduler.make_stats", {"0.32": "9accb27a065c", "0.33": "9accb27a065c"},
             "wrapped: we replace spec_decoding_stats with our step counts"),
    Reviewed(
        "vllm.platforms.cpu", "CpuPlatform.check_and_update_config",
        {"0.32": "130180b09f4e", "0.33": "00f9a6726507", "0.34": "85d6984ebd64"},
        "0.32 sets block_size 128 when the user gave none; 0.33 does not (moved to "
        "update_block_size_for_backend): compat.set_default_block_size pins 128 on CPU; 0.34 "
        "refuses x86 CPUs without triton-cpu (vLLM's own runner needs it; a vLLM CPU install "
        "brings it), where 0.33 only warned",
    ),
    Reviewed(
        "vllm.platforms.cpu", "CpuPlatform.update_block_size_for_backend",
        {"0.32": "946ec20867cd", "0.33": "735751ba3b51"},
        "0.33 picks 128 here, but only for models with vLLM attention layers; ours have none, "
        "so it returns early and our default stands",
    ),
    Reviewed(
        "vllm.v1.worker.cpu_worker", "CPUWorker.init_device",
        {"0.32": "f3495bdcec2a", "0.33": "f3495bdcec2a", "0.34": "b96a06e4ec2b"},
        "builds vLLM's runner last; DiffusionCPUWorker replaces it right after; 0.34 builds the "
        "V2 CPU runner (or the standalone one off x86) where 0.33 chose by the V1/V2 switch, and that "
        "runner needs triton-cpu: compat.init_cpu_worker_device repeats the set-up before it (device, "
        "VLLM_DIST_IDENT, the distributed group, the seed; not its LD_PRELOAD hints nor its lock on "
        "torch.set_num_threads) and builds no vLLM runner",
    ),
    Reviewed(
        "vllm.v1.worker.cpu_worker", "CPUWorker.compile_or_warm_up_model",
        {"0.32": "ed8a75bff566", "0.33": "cbcd8ad2a96e", "0.34": "efcfcf6a04d0"},
        "calls model_runner.warming_up_model (ours: a profile step); 0.33 also warms up V2 "
        "kernels on the runner when V2 is on: compat.keep_v1_model_runner keeps V2 off on CPU; "
        "0.34 warms them up whenever kernel_config.enable_jit_warmup is on: "
        "compat.keep_vllm_runner_warmups_off turns it off for our models",
    ),
    Reviewed(
        "vllm.v1.worker.cpu_worker", "CPUWorker.determine_available_memory",
        {"0.32": "def2e56b1873", "0.33": "6779b8f400e6"},
        "sizes the KV pool from RAM after our profile step; 0.33 only splits and rewords the "
        "too-little-memory error",
    ),
    Reviewed(
        "vllm.config.vllm", "VllmConfig.use_v2_model_runner",
        {"0.32": "0037f1366c67", "0.33": "96c896e3b1df"},
        "VLLM_USE_V2_MODEL_RUNNER=0 (set by compat.keep_v1_model_runner) wins, except that "
        "HiSparse and watermarking force V2 (both versions; neither works with vllm-dllm); 0.33 "
        "only exempts unspecified platforms from the no-Triton fallback",
        versions=BEFORE_034,
    ),
    Reviewed(
        "vllm.v1.worker.gpu_worker", "Worker.initialize_from_config",
        {"0.34": "d479667d6626"},
        "binds the KV cache through model_runner.initialize_kv_cache; with the extensible KV cache "
        "(0.34's default on CUDA) it also reads model_runner.extensible_kv_cache, which ours does "
        "not have: compat.keep_vllm_runner_warmups_off turns it off for our models",
        versions=FROM_034,
    ),
)

# ---- what vLLM's workers call on the model runner ---------------------------------------------

_LORA = "LoRA is not supported (lora_config is None)"
_V2 = "V2 model runner only; keep_v1_model_runner keeps V2 off"
_EXTENSIBLE = "extensible KV cache only, off for our models (compat.keep_vllm_runner_warmups_off)"
_GPU_OVERRIDDEN = "on paths DiffusionGPUWorker overrides (determine_available_memory / compile_or_warm_up_model)"
RUNNER_CALLS: tuple[RunnerCalls, ...] = (
    RunnerCalls(
        # ray_utils: Ray's worker wrapper (--distributed-executor-backend ray) steps the
        # runner itself: execute_model, then sample_tokens only if it returned None.
        modules=("vllm.v1.worker.worker_base", "vllm.v1.worker.gpu_worker", "vllm.v1.worker.cpu_worker",
                 "vllm.v1.executor.ray_utils"),
        provided=frozenset({
            "load_model", "get_model", "get_supported_tasks", "update_max_model_len", "get_kv_cache_spec",
            "initialize_kv_cache", "take_draft_token_ids", "get_draft_model", "get_encoder_timing_stats",
            "maybe_remove_all_loras", "shutdown", "reset_mm_cache", "reset_encoder_cache", "sample_tokens",
            "execute_model", "warming_up_model", "is_pooling_model", "lora_config", "model", "kv_caches",
            "supports_mm_inputs",
        }),
        not_needed={
            "_dummy_run": _GPU_OVERRIDDEN,
            "_dummy_sampler_run": _GPU_OVERRIDDEN,
            "_dummy_pooler_run": "pooling models only",
            "capture_model": _GPU_OVERRIDDEN,
            "profile_run": _GPU_OVERRIDDEN,
            "profile_cudagraph_memory": _GPU_OVERRIDDEN,
            "model_memory_usage": _GPU_OVERRIDDEN,
            "_init_kv_zero_meta": "called only if the runner has it (hasattr)",
            "needs_cudagraph_capture": _V2,
            "pool": "pooling models only",
            "eplb": _V2 + " (new in 0.33, inside compile_or_warm_up_model, which DiffusionGPUWorker overrides)",
            "reload_weights": "weight reloading (RL) is not supported",
            "decode_query_len": "execute_dummy_batch only, with _dummy_run (new in 0.34): the dummy step of an "
                                "idle data-parallel rank of an MoE model, whose data parallelism vllm-dllm refuses",
            "extensible_kv_cache": _EXTENSIBLE + " (new in 0.34)",
            "profile_adaptive_verification": "speculative decoding only (refused), and only if the runner has "
                                             "adaptive_verification (new in 0.34)",
            "add_lora": _LORA,
            "remove_lora": _LORA,
            "list_loras": _LORA,
            "pin_lora": _LORA,
            "reset_lora_state": _LORA,
        },
    ),
)
