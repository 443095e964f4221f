"""What a new vLLM release needs reviewed rather than merely found:
- REVIEWED: functions whose behaviour the plugin depends on, with the code fingerprints
  of the versions reviewed and how the plugin handles each;
- RUNNER_CALLS: what vLLM's workers call on `self.model_runner`, each either provided
  by DiffusionModelRunner or on a path our workers never take.
"""

from __future__ import annotations

from vllm_dllm.serving.vllm_surface.records import BEFORE_034, FROM_034, SCHED, Reviewed, RunnerCalls

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
