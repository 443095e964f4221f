"""Diffusion decoding options: defaults, per-request overrides, validation.

Precedence, lowest first: the papers' defaults, the model's generation_config.json,
the server's `--additional-config '{"dllm": {...}}'`, the request's
`SamplingParams.extra_args` (`vllm_xargs` in the OpenAI API).  Temperature, top_p,
top_k and seed are vLLM's own SamplingParams fields and are read from there.

Everything here is pure: the same function validates a request in the API process,
prices it in the scheduler and configures its decoding in the worker.  The
server-wide settings these resolve against (ServerDefaults) are built from this
package one level up; it does not import them back.

The package, one job a module:
  common.py    what every kind shares: OptionError, type and range checks, the
               KV-cache and parallel-decoding options, blocks, the DecodingKind record;
  llada.py     LLaDA's options, keys, paper defaults and resolver;
  dream.py     Dream's options, keys, paper defaults, filters and resolver;
  llada2.py    LLaDA2.x's options (block diffusion, token editing, modes, the parallel
               decoding keys with its own `threshold`) and resolver;
  registry.py  the decoding kinds (KINDS), and what dispatches on the kind.
This module is the public surface: import from `vllm_dllm.options`.
"""

from vllm_dllm.options.common import (
    _CACHE_KEYS,
    _PARALLEL_KEYS,
    _SAMPLING_PARAM_FIELDS,
    CACHE_DEFAULTS,
    CACHE_POLICIES,
    DECODING_PARAMETERS,
    DECODING_RULES,
    FILTER_KEYS,
    MAX_POOL_KERNEL,
    NEUTRAL_TOP_K,
    NEUTRAL_TOP_P,
    PARALLEL_DEFAULTS,
    SERVER,
    SPARSE_KEYS,
    SPARSE_SCORINGS,
    SPARSE_SELECTIONS,
    DecodingKind,
    CanvasPlacement,
    KVCacheOptions,
    OptionError,
    ParallelDecodingOptions,
    ResolveInput,
    ServerSettings,
    _block_length,
    _cache_options,
    _check_type,
    _delay_step,
    _one_of,
    _parallel_options,
    _positive_int,
    check_cache_knobs,
    is_filter,
    sequence_copies,
)
from vllm_dllm.options.dream import (
    DREAM,
    DREAM_ALGS,
    DREAM_FILTER_KEYS,
    MAX_STEPS_PER_TOKEN,
    MIN_ALG_TEMP,
    DreamOptions,
    resolve_dream,
)
from vllm_dllm.options.llada import LLADA, LLADA_REMASKING, LLaDAOptions, llada_has_no_filter, resolve_llada
from vllm_dllm.options.llada2 import LLADA2, LLADA2_MODES, LLaDA2Options, resolve_llada2
from vllm_dllm.options.registry import (
    _REQUEST_KEYS,
    KINDS,
    KIND_NAMES,
    PAPER_DEFAULTS,
    RELEASE_SPECIAL_IDS,
    DecodeOptions,
    _unknown_key,
    check_overrides,
    defaults_from_generation_config,
    resolve,
    resolve_params,
)

__all__ = [
    "CACHE_DEFAULTS",
    "CACHE_POLICIES",
    "DECODING_PARAMETERS",
    "DECODING_RULES",
    "DREAM",
    "DREAM_ALGS",
    "DREAM_FILTER_KEYS",
    "KINDS",
    "FILTER_KEYS",
    "KIND_NAMES",
    "LLADA",
    "LLADA_REMASKING",
    "LLADA2",
    "LLADA2_MODES",
    "RELEASE_SPECIAL_IDS",
    "LLaDA2Options",
    "resolve_llada2",
    "CanvasPlacement",
    "MAX_POOL_KERNEL",
    "MAX_STEPS_PER_TOKEN",
    "MIN_ALG_TEMP",
    "NEUTRAL_TOP_K",
    "NEUTRAL_TOP_P",
    "PAPER_DEFAULTS",
    "PARALLEL_DEFAULTS",
    "SERVER",
    "SPARSE_KEYS",
    "SPARSE_SCORINGS",
    "SPARSE_SELECTIONS",
    "DecodeOptions",
    "DreamOptions",
    "DecodingKind",
    "KVCacheOptions",
    "LLaDAOptions",
    "OptionError",
    "ParallelDecodingOptions",
    "ResolveInput",
    "ServerSettings",
    "check_cache_knobs",
    "check_overrides",
    "defaults_from_generation_config",
    "is_filter",
    "llada_has_no_filter",
    "resolve",
    "resolve_params",
    "resolve_dream",
    "resolve_llada",
    "sequence_copies",
    # Private helpers, kept importable from here as before the split.
    "_CACHE_KEYS",
    "_PARALLEL_KEYS",
    "_REQUEST_KEYS",
    "_SAMPLING_PARAM_FIELDS",
    "_block_length",
    "_cache_options",
    "_check_type",
    "_delay_step",
    "_one_of",
    "_parallel_options",
    "_positive_int",
    "_unknown_key",
]
