"""OVERRIDES: methods the plugin overrides, or that vLLM calls on its duck-typed objects
with vLLM's own signature (the schedulers', stat loggers', workers', logits processors',
endpoint plugins' and model runners'): parameter names, kinds and defaults must be
exactly these.
"""

from __future__ import annotations

from vllm_dllm.serving.vllm_surface.records import BEFORE_034, FROM_034, SCHED, Override

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
