"""Engine configuration for served diffusion models: the MODELS_CONFIG_MAP hook.

vLLM calls the hook in the API/LLM process while it builds the config, before the
platform fills in its own worker and scheduler.  The resolved server defaults are
stored in `additional_config` so the engine-core and worker processes (which receive
a pickled copy of the config) see exactly what the front end validated against.
"""

from __future__ import annotations

import dataclasses
import os
from importlib.metadata import entry_points
from typing import Any


from vllm_dllm.log import get_logger
from vllm_dllm.serving.compat import (
    RESERVED_CPU_ENV,
    keep_v1_model_runner,
    keep_vllm_compilation_off,
    keep_vllm_runner_warmups_off,
    reserve_no_cpu_on_small_machine,
    set_default_block_size,
)
from vllm_dllm.families import family_of
from vllm_dllm.models import cpu_rms_norm
from vllm_dllm.serving.openmp_spin import SMALL_MACHINE_SPIN, SPIN_ENV, shorten_spin_on_small_machine
from vllm_dllm.options import (
    DREAM_FILTER_KEYS,
    LLADA,
    LLADA2,
    OptionError,
    is_filter,
)
from vllm_dllm.options.llada2 import unsupported_release
from vllm_dllm.serving.server_defaults import ServerDefaults
from vllm_dllm.serving.validation import is_validator, validator_for

logger = get_logger(__name__)

RESOLVED_KEY = "dllm_resolved"
USER_KEY = "dllm"

SCHEDULER_CLS = "vllm_dllm.scheduler.scheduler.DiffusionScheduler"
CPU_WORKER_CLS = "vllm_dllm.worker.cpu_worker.DiffusionCPUWorker"
GPU_WORKER_CLS = "vllm_dllm.worker.gpu_worker.DiffusionGPUWorker"
DEFAULT_GEN_LENGTH = 128  # the LLaDA reference's default gen_length (see frontend.py)

LOGITS_PROCESSOR_PLUGIN_GROUP = "vllm.logits_processors"  # vLLM's LOGITSPROCS_GROUP

ASYNC_SCHEDULING_REFUSAL = (
    "vllm-dllm does not support --async-scheduling: the scheduler prices each denoising step "
    "(a Refresh or a Reuse, and its query tokens) from where the previous step left the request "
    "(its block and step in block), so it cannot plan a step before the one running has ended; "
    "drop the flag (these models serve with async scheduling off)"
)

# Families whose attention is block-causal (phases.py): the K/V of a prompt's whole
# blocks depend on those blocks alone, so vLLM may chunk their prefill and cache them.
BLOCK_CAUSAL_KINDS = (LLADA2,)

def server_defaults(vllm_config) -> ServerDefaults:
    return ServerDefaults.from_dict(vllm_config.additional_config[RESOLVED_KEY])



def served_kind(model_config) -> str | None:
    """The decoding kind of the model's family (families.py); None: not ours."""
    family = family_of(model_config.hf_config)
    return family.kind if family else None


def _generation_config(model_config) -> dict[str, Any]:
    """generation_config.json as written: transformers' GenerationConfig drops the
    diffusion keys (alg, steps, eps) of files marked `_from_model_config`."""
    from vllm.transformers_utils.repo_utils import get_hf_file_to_dict

    try:
        config = get_hf_file_to_dict(
            "generation_config.json", model_config.model, model_config.revision
        )
    except Exception:  # a missing or unreadable file means "no defaults"
        return {}
    return dict(config or {})


def _with_vllm_filter_defaults(gen_config: dict[str, Any], model_config) -> dict[str, Any]:
    """generation_config.json with top_k / top_p as vLLM resolved them: the file as
    `--generation-config` selects it, then `--override-generation-config`.  vLLM
    applies these itself only at temperature > 0; Dream's rule needs them at 0 too."""
    sampling = model_config.get_diff_sampling_param()
    out = {k: v for k, v in gen_config.items() if k not in DREAM_FILTER_KEYS}
    out.update({k: sampling[k] for k in DREAM_FILTER_KEYS if k in sampling})
    return out


class DiffusionConfigHook:
    """Registered in vLLM's MODELS_CONFIG_MAP for LLaDAModelLM and DreamModel."""

    @staticmethod
    def verify_and_update_model_config(model_config) -> None:
        kind = served_kind(model_config)
        if kind is None:
            return
        if kind == LLADA2:
            problem = unsupported_release(model_config.hf_config)
            if problem:
                raise ValueError(f"{model_config.model}: {problem}")
        overrides = dict(model_config.override_generation_config or {})
        gen_config = _generation_config(model_config)
        if kind in (LLADA, LLADA2) and "temperature" not in gen_config:
            # The LLaDA and LLaDA2 references decode greedily unless asked otherwise;
            # their generation_config.json says nothing about temperature.
            overrides.setdefault("temperature", 0.0)
        if kind == LLADA:
            for key in DREAM_FILTER_KEYS:
                if is_filter(key, gen_config.get(key)):
                    # LLaDA's reference has no top-k/top-p: a checkpoint's value would
                    # make vLLM refuse every sampled request.  The user's own
                    # --override-generation-config still wins (and fails at start-up).
                    logger.warning(
                        "Ignoring %s=%s from generation_config.json: LLaDA decoding has no "
                        "top-k/top-p filter.", key, gen_config[key],
                    )
                    overrides.setdefault(key, 0 if key == "top_k" else 1.0)
        # No max_new_tokens here: vLLM's OpenAI server reads an overridden
        # max_new_tokens as a server-wide cap, not a default (it silently lowered
        # every larger max_tokens).  The default canvas of a request without
        # max_tokens is set by the HTTP front end (frontend.py).
        model_config.override_generation_config = overrides

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        model_config = vllm_config.model_config
        kind = served_kind(model_config)
        if kind is None:
            return
        additional = vllm_config.additional_config
        gen_config = _with_vllm_filter_defaults(_generation_config(model_config), model_config)
        if kind == LLADA:
            for key in DREAM_FILTER_KEYS:
                if is_filter(key, gen_config.get(key)):
                    raise OptionError(
                        f"--override-generation-config sets {key}={gen_config[key]}, but LLaDA's "
                        f"reference decoding has no top-k/top-p filter; remove '{key}'"
                    )
        defaults = ServerDefaults.build(kind, gen_config, additional.get(USER_KEY, {}))
        defaults = dataclasses.replace(defaults, sparse_refusal=_sparse_refusal(vllm_config))
        if defaults.overrides.get("cache") == "sparse" and defaults.sparse_refusal:
            raise OptionError(f"{USER_KEY} 'cache': {defaults.sparse_refusal}")
        additional[RESOLVED_KEY] = defaults.to_dict()

        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size > 1:
            raise ValueError(
                "vllm-dllm does not support pipeline parallelism: a denoising step needs "
                "the whole model; use tensor parallelism"
            )
        if parallel.data_parallel_size > 1 and family_of(model_config.hf_config).moe:
            # vLLM's MoE layers coordinate every forward across data-parallel ranks;
            # our runner has no dummy step for an idle rank to join with.
            raise ValueError(
                "vllm-dllm does not support data parallelism for MoE models (LLaDA2, LLaDA-MoE) yet: "
                "use --tensor-parallel-size (with --enable-expert-parallel to split the experts)"
            )
        _refuse_unsupported_features(vllm_config)
        if not defaults.any_whitespace:
            _compact_json(vllm_config.structured_outputs_config)
        _warn_of_unapplied_logits_processor_plugins()
        if parallel.worker_cls == "auto":
            parallel.worker_cls = _worker_cls(vllm_config)
        # Our runner is V1-shaped on every device and vLLM version; the block-size
        # default moved between vLLM versions (compat.py).
        keep_v1_model_runner()
        keep_vllm_runner_warmups_off(vllm_config)
        device = _device()
        set_default_block_size(vllm_config.cache_config, device)
        if device == "cuda":
            keep_vllm_compilation_off(vllm_config.compilation_config)
        if device == "cpu" and cpu_rms_norm.prefer_on_cpu(vllm_config.kernel_config):
            logger.debug("RMSNorm on the CPU: vLLM's C++ kernel (%s) first, then native", cpu_rms_norm.PROVIDER)
        _check_kv_cache_dtype(vllm_config.cache_config, model_config)
        _check_logprobs_settings(model_config)
        if device == "cpu" and reserve_no_cpu_on_small_machine():
            logger.info(
                "%d usable CPUs: giving vLLM's CPU worker all of them (%s=0; set it to "
                "keep vLLM's default of one core reserved for the engine core).",
                len(os.sched_getaffinity(0)), RESERVED_CPU_ENV,
            )
        if device == "cpu" and shorten_spin_on_small_machine():
            logger.info(
                "%d usable CPUs: idle OpenMP threads spin %d times before they sleep (%s; set it, or "
                "OMP_WAIT_POLICY, to choose your own), leaving the engine core a core between steps.",
                len(os.sched_getaffinity(0)), SMALL_MACHINE_SPIN, SPIN_ENV,
            )
        scheduler = vllm_config.scheduler_config
        if scheduler.scheduler_cls in (None, "vllm.v1.core.sched.scheduler.Scheduler"):
            scheduler.scheduler_cls = SCHEDULER_CLS
        scheduler.async_scheduling = False
        if kind not in BLOCK_CAUSAL_KINDS:
            # A step recomputes or rewrites whole sequences; bidirectional KV is not
            # prefix-stable, so cached prefixes would be wrong.  Block-causal K/V of
            # whole prompt blocks are (scheduler/prefix_cache.py): vLLM's setting stands.
            vllm_config.cache_config.enable_prefix_caching = False
        chunked = kind in BLOCK_CAUSAL_KINDS and scheduler.enable_chunked_prefill
        if scheduler.max_num_batched_tokens < model_config.max_model_len and not chunked:
            logger.info(
                "Raising max_num_batched_tokens from %d to max_model_len %d: one "
                "denoising step runs a whole sequence.",
                scheduler.max_num_batched_tokens,
                model_config.max_model_len,
            )
            scheduler.max_num_batched_tokens = model_config.max_model_len
        # The request validator, bound to these defaults (validation.py).
        model_config.logits_processors = [validator_for(defaults)]


# The structured-output backends that can leave whitespace out of JSON ("auto" picks
# one of them per request).
COMPACT_JSON_BACKENDS = ("auto", "xgrammar", "guidance")


def _compact_json(structured_outputs_config) -> None:
    """JSON grammars without optional whitespace.  A canvas has a fixed length, and
    a diffusion model fills positions the grammar leaves open with whatever it allows
    there: whitespace would eat the canvas.  vLLM's option is a plain bool, so an
    explicit `disable_any_whitespace: false` cannot be told from its default; the
    server's own `any_whitespace` restores vLLM's behaviour."""
    if structured_outputs_config.disable_any_whitespace:
        return
    backend = structured_outputs_config.backend
    if backend not in COMPACT_JSON_BACKENDS:
        logger.warning(
            "The %s structured-output backend cannot leave whitespace out of JSON: a JSON request may "
            "spend its canvas on whitespace; use xgrammar or guidance for compact JSON", backend)
        return
    # Set after construction: vLLM's own check refuses the option with backend "auto",
    # which chooses one of the backends above per request.
    structured_outputs_config.disable_any_whitespace = True


def _refuse_unsupported_features(vllm_config) -> None:
    """vLLM features a user may ask for that our engine would otherwise ignore or fail
    on obscurely: refused at start-up, naming the flag."""
    if vllm_config.scheduler_config.async_scheduling:
        # Explicitly asked for (vLLM's own default is resolved after this hook):
        # refused as vLLM refuses an async scheduling it cannot honour.
        raise ValueError(ASYNC_SCHEDULING_REFUSAL)
    if vllm_config.lora_config is not None:
        # The runner applies no adapter: a LoRA request would be served by the base model.
        raise ValueError(
            "vllm-dllm does not support LoRA adapters yet (--enable-lora): a request naming an "
            "adapter would be answered by the base model; serve a merged checkpoint instead"
        )
    if vllm_config.model_config.enable_prompt_embeds:
        # A request carrying embeddings has no prompt token ids, which every Refresh re-reads.
        raise ValueError(
            "vllm-dllm does not support prompt embeddings (--enable-prompt-embeds): each Refresh "
            "step re-reads the prompt's token ids; send token ids or text"
        )
    custom = [p for p in vllm_config.model_config.logits_processors or () if not is_validator(p)]
    if custom:
        # Our runner applies no logits processor: vLLM would run their validation and
        # never their `apply`.
        names = ", ".join(p if isinstance(p, str) else f"{p.__module__}.{p.__qualname__}" for p in custom)
        raise ValueError(
            f"vllm-dllm does not apply custom logits processors (--logits-processors {names}): a "
            "denoising step scores every masked canvas position at once, not one next token; for "
            "constrained output use structured outputs"
        )
    if vllm_config.kv_transfer_config is not None:
        raise ValueError(
            "vllm-dllm does not support KV transfer (--kv-transfer-config): the diffusion runner "
            "never calls a KV connector, so nothing would be sent or received; serve without it"
        )
    if vllm_config.speculative_config is not None:
        raise ValueError(
            "vllm-dllm does not support speculative decoding (--speculative-config): a denoising "
            "step already commits several canvas positions at once (see the parallel decoding "
            "rules); drop the flag"
        )


def _warn_of_unapplied_logits_processor_plugins() -> None:
    """vLLM's stock runner applies every installed `vllm.logits_processors` entry point
    to every request; ours applies none.  vLLM skips them for pooling models the same
    way, at debug level: here the user hears it at start-up, by name.  A request
    that asks such a plugin for something through `vllm_xargs` is refused by the
    options check (an unknown diffusion option)."""
    plugins = entry_points(group=LOGITS_PROCESSOR_PLUGIN_GROUP)
    if plugins:
        logger.warning(
            "vllm-dllm applies no logits processors: the installed plugins %s (entry-point group %s) "
            "will not change any output of this server",
            ", ".join(f"{p.name} = {p.value}" for p in sorted(plugins, key=lambda p: p.name)),
            LOGITS_PROCESSOR_PLUGIN_GROUP,
        )


def _sparse_refusal(vllm_config) -> str | None:
    """The sparse cache ranks a KV head's positions by the attention of its query
    heads.  With fewer KV heads than tensor-parallel ranks vLLM replicates each KV
    head on ranks that hold different query heads, so each copy would keep other
    positions than one device does."""
    tp = vllm_config.parallel_config.tensor_parallel_size
    kv_heads = vllm_config.model_config.get_total_num_kv_heads()
    if tp <= kv_heads:
        return None
    return (
        f"the sparse KV cache is not supported with --tensor-parallel-size {tp} on a model with {kv_heads} "
        f"KV head(s): each KV head is replicated on ranks holding different query heads, which would keep "
        f"different positions; use cache 'dual', or a tensor-parallel size of at most {kv_heads}"
    )


def prefill_chunk(vllm_config) -> int:
    """Most tokens one prefill step of a block-causal request runs (0: its prefix in
    one step): vLLM's chunked-prefill settings, a long prompt's chunk capped by
    --long-prefill-token-threshold, else by the step's token budget."""
    scheduler = vllm_config.scheduler_config
    if served_kind(vllm_config.model_config) not in BLOCK_CAUSAL_KINDS or not scheduler.enable_chunked_prefill:
        return 0
    budget, threshold = scheduler.max_num_batched_tokens, scheduler.long_prefill_token_threshold
    return threshold if 0 < threshold < budget else budget


def _check_logprobs_settings(model_config) -> None:
    """Logprobs are the model's own distribution at the committing step, kept per
    position up to --max-logprobs entries (decoding/logprobs.py)."""
    if model_config.logprobs_mode != "raw_logprobs":
        raise ValueError(
            f"--logprobs-mode {model_config.logprobs_mode} is not supported by vllm-dllm: logprobs are "
            "the model's distribution at the step that committed each token (raw_logprobs)"
        )
    if model_config.max_logprobs < 0:
        raise ValueError(
            "--max-logprobs -1 (the whole vocabulary) is not supported by vllm-dllm: each committed "
            "position keeps its top entries until it streams; give a number (vLLM's default is 20)"
        )


def _check_kv_cache_dtype(cache_config, model_config) -> None:
    """K/V stay in the model's dtype: the pool has no scales for a quantized cache."""
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype

    if kv_cache_dtype_str_to_dtype(cache_config.cache_dtype, model_config) != model_config.dtype:
        dtype = str(model_config.dtype).removeprefix("torch.")
        raise ValueError(
            f"--kv-cache-dtype {cache_config.cache_dtype} is not supported by vllm-dllm: the KV "
            f"cache holds K/V in the model's dtype ({dtype}); leave it at auto"
        )


def _worker_cls(vllm_config) -> str:
    return CPU_WORKER_CLS if _device() == "cpu" else GPU_WORKER_CLS


def _device() -> str:
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "cpu"
    if current_platform.is_cuda():
        return "cuda"
    raise RuntimeError(
        f"vllm-dllm supports CPU and CUDA platforms, not {current_platform.device_name}"
    )
