"""Diffusion decoding options: defaults, per-request overrides, validation.

Precedence, lowest first: the papers' defaults, the model's generation_config.json,
the server's `--additional-config '{"dllm": {...}}'`, the request's
`SamplingParams.extra_args` (`vllm_xargs` in the OpenAI API).  Temperature, top_p,
top_k and seed are vLLM's own SamplingParams fields and are read from there.

Everything here is pure: the same function validates a request in the API process,
prices it in the scheduler and configures its decoding in the worker.  The
server-wide settings these resolve against live in server_defaults.py.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_dllm.server_defaults import ServerDefaults

LLADA = "llada"
DREAM = "dream"

ARCHITECTURE_KINDS = {"LLaDAModelLM": LLADA, "DreamModel": DREAM}

LLADA_REMASKING = ("low_confidence", "random")
CACHE_POLICIES = ("none", "prefix", "dual", "sparse")
SPARSE_SELECTIONS = ("head", "uniform")  # see attention/sparse.py
SPARSE_SCORINGS = ("max", "mean")
MAX_POOL_KERNEL = 63  # the sparse selection's max-pool window (one op per offset)
DREAM_ALGS = ("origin", "maskgit_plus", "topk_margin", "entropy")
DECODING_RULES = ("fixed", "threshold", "factor", "entropy_bound", "hierarchy", "credit")  # see decoding/parallel.py


class OptionError(ValueError):
    """A diffusion option is missing, malformed or inconsistent."""


@dataclass(frozen=True, kw_only=True)
class ParallelDecodingOptions:
    """Parallel decoding (decoding/parallel.py): the rule and its parameters."""

    decoding: str = "fixed"
    threshold: float = 0.9  # threshold, hierarchy (upper), credit
    factor: float = 1.0  # factor
    gamma: float = 1.0  # entropy_bound
    low_threshold: float = 0.3  # hierarchy
    credit_alpha: float = 0.7  # credit
    credit_decay: float = 0.8
    credit_boost: float = 0.2
    max_tokens_per_step: int = 0  # every parallel rule; 0: no cap


@dataclass(frozen=True, kw_only=True)
class KVCacheOptions:
    """KV reuse across steps (phases.py) and, for `sparse`, what the cache keeps
    (attention/sparse.py): per KV head the `retention` share of the positions outside
    the active block, ranked by the block's queries' logits (`scoring`: the largest,
    or the mean query's) max-pooled over `pool_kernel` positions; `selection` uniform
    keeps one set shared by all heads."""

    cache: str = "none"
    refresh_interval: int = 0
    delay_step: int = 0
    retention: float = 0.5
    pool_kernel: int = 3
    selection: str = "head"
    scoring: str = "max"


@dataclass(frozen=True)
class LLaDAOptions(KVCacheOptions, ParallelDecodingOptions):
    gen_length: int
    steps: int
    block_length: int
    remasking: str
    temperature: float
    cfg_scale: float
    logits_eos_inf: bool
    confidence_eos_eot_inf: bool

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block_length

    @property
    def steps_per_block(self) -> int:
        return self.steps // self.num_blocks

    @property
    def uses_cfg(self) -> bool:
        return self.cfg_scale > 0


@dataclass(frozen=True)
class DreamOptions(KVCacheOptions, ParallelDecodingOptions):
    gen_length: int
    steps: int
    eps: float
    alg: str
    alg_temp: float | None
    temperature: float
    top_p: float | None
    top_k: int | None
    # KV reuse over the canvas split into blocks, Dream's rule (alg, schedule, filters)
    # inside each block; None: one block, the reference's whole-canvas decoding.
    block_length: int | None = None

    @property
    def num_blocks(self) -> int:
        return self.gen_length // (self.block_length or self.gen_length)

    @property
    def steps_per_block(self) -> int:
        return self.steps // self.num_blocks

    @property
    def uses_cfg(self) -> bool:
        return False


DecodeOptions = LLaDAOptions | DreamOptions

PARALLEL_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ParallelDecodingOptions)}
_PARALLEL_KEYS = {
    name: (str,) if name == "decoding" else (int,) if name == "max_tokens_per_step" else (int, float)
    for name in PARALLEL_DEFAULTS
}

_CACHE_KEYS = {
    "cache": (str,),
    "refresh_interval": (int,),
    "delay_step": (int,),
    "retention": (int, float),
    "pool_kernel": (int,),
    "selection": (str,),
    "scoring": (str,),
}
SPARSE_KEYS = ("retention", "pool_kernel", "selection", "scoring")

# Per-request keys and their accepted types.  bool is checked before int because
# bool is a subclass of int in Python.
_REQUEST_KEYS: dict[str, dict[str, tuple[type, ...]]] = {
    LLADA: {
        "steps": (int,),
        "block_length": (int,),
        "remasking": (str,),
        "cfg_scale": (int, float),
        "logits_eos_inf": (bool,),
        "confidence_eos_eot_inf": (bool,),
        **_CACHE_KEYS,
        **_PARALLEL_KEYS,
    },
    DREAM: {
        "steps": (int,),
        "eps": (int, float),
        "alg": (str,),
        "alg_temp": (int, float, type(None)),
        # vLLM resets its own top_k/top_p fields at temperature 0, but Dream's
        # reference still renormalises its confidences over the top-k/top-p set
        # there: extra_args is the route that survives (see resolve()).
        "top_k": (int,),
        "top_p": (int, float),
        "block_length": (int,),
        **_CACHE_KEYS,
        **_PARALLEL_KEYS,
    },
}

# Dream keys that are vLLM sampling fields as well: server-wide defaults come from
# vLLM's own generation-config route, not from --additional-config.
DREAM_FILTER_KEYS = ("top_k", "top_p")
# vLLM's "no filter" values of its sampling fields.
NEUTRAL_TOP_K = (0, -1)
NEUTRAL_TOP_P = 1.0


def is_filter(key: str, value: Any) -> bool:
    """Whether a top_k / top_p value asks for a filter (vLLM's neutral values do not)."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return value not in NEUTRAL_TOP_K if key == "top_k" else value < NEUTRAL_TOP_P


# vLLM's own fields: naming them in extra_args would be ambiguous (Dream's top_k /
# top_p excepted, see _REQUEST_KEYS).
_SAMPLING_PARAM_FIELDS = ("temperature", "top_p", "top_k", "seed", "max_tokens")
KIND_NAMES = {LLADA: "LLaDA", DREAM: "Dream"}

# delay_step None: the policy's own (Sparse-dLLM's one-step delayed update for sparse,
# none for prefix/dual as in Fast-dLLM); see _delay_step.
CACHE_DEFAULTS = {"cache": "none", "refresh_interval": 0, "delay_step": None,
                  "retention": 0.5, "pool_kernel": 3, "selection": "head", "scoring": "max"}

PAPER_DEFAULTS: dict[str, dict[str, Any]] = {
    LLADA: {
        "block_length": 32,
        "remasking": "low_confidence",
        "cfg_scale": 0.0,
        "logits_eos_inf": False,
        "confidence_eos_eot_inf": False,
        **CACHE_DEFAULTS,
        **PARALLEL_DEFAULTS,
    },
    DREAM: {
        "eps": 1e-3,
        "alg": "origin",
        "alg_temp": None,
        **CACHE_DEFAULTS,
        **PARALLEL_DEFAULTS,
    },
}


def _check_type(key: str, value: Any, types: tuple[type, ...], prefix: str = "") -> None:
    if isinstance(value, bool) and bool not in types:
        ok = False
    elif types == (bool,) and not isinstance(value, bool):
        # vLLM's OpenAI protocol types vllm_xargs values as str | int | float, so a
        # JSON true/false arrives as 1/0.
        ok = type(value) is int and value in (0, 1)
    else:
        ok = isinstance(value, types)
    if not ok:
        names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
        raise OptionError(
            f"{prefix}diffusion option '{key}' must be {names}, got {type(value).__name__} {value!r}"
        )


MAX_STEPS_PER_TOKEN = 8
MIN_ALG_TEMP = 1e-3


def _one_of(choices: tuple[str, ...]) -> str:
    if len(choices) == 1:
        return choices[0]
    return ", ".join(choices[:-1]) + " or " + choices[-1]


def _range_problem(key: str, value: Any, prefix: str = "") -> str | None:
    """Why a well-typed option value is out of range, as one sentence, or None.

    `prefix` names where the option was set ("" for a request)."""
    option = f"{prefix}diffusion option '{key}'"
    if isinstance(value, float) and not math.isfinite(value):
        return f"{option} must be a finite number, got {value}"
    if key == "alg_temp" and value is not None and 0 < value < MIN_ALG_TEMP:
        return f"{option} must be 0 or at least {MIN_ALG_TEMP}, got {value}"
    if key in ("steps", "block_length") and value <= 0:
        return f"{option} must be a positive integer, got {value}"
    # The value the user typed first, then what is allowed.
    if key == "remasking" and value not in LLADA_REMASKING:
        return f"{prefix}unknown remasking '{value}': diffusion option 'remasking' must be {_one_of(LLADA_REMASKING)}"
    if key == "cache" and value not in CACHE_POLICIES:
        return f"{prefix}unknown cache policy '{value}': diffusion option 'cache' must be {_one_of(CACHE_POLICIES)}"
    if key == "selection" and value not in SPARSE_SELECTIONS:
        return f"{prefix}unknown selection '{value}': diffusion option 'selection' must be {_one_of(SPARSE_SELECTIONS)}"
    if key == "scoring" and value not in SPARSE_SCORINGS:
        return f"{prefix}unknown scoring '{value}': diffusion option 'scoring' must be {_one_of(SPARSE_SCORINGS)}"
    if key == "retention" and not 0 < value <= 1:
        return f"{option} must lie in (0, 1], got {value}"
    if key == "pool_kernel" and not (1 <= value <= MAX_POOL_KERNEL and value % 2 == 1):
        return f"{option} must be an odd integer from 1 to {MAX_POOL_KERNEL}, got {value}"
    if key == "decoding" and value not in DECODING_RULES:
        return f"{prefix}unknown decoding rule '{value}': diffusion option 'decoding' must be {_one_of(DECODING_RULES)}"
    if key in ("threshold", "low_threshold") and not 0 < value <= 1:
        return f"{option} must lie in (0, 1], got {value}"
    if key in ("factor", "gamma", "credit_boost") and value <= 0:
        return f"{option} must be > 0, got {value}"
    if key == "credit_alpha" and value < 0:
        return f"{option} must be >= 0, got {value}"
    if key == "credit_decay" and not 0 <= value <= 1:
        return f"{option} must lie in [0, 1], got {value}"
    if key == "max_tokens_per_step" and value < 0:
        return f"{option} must be >= 0 (0: no cap), got {value}"
    if key == "alg" and value not in DREAM_ALGS:
        return f"{prefix}unknown alg '{value}': diffusion option 'alg' must be {_one_of(DREAM_ALGS)}"
    if key in ("refresh_interval", "delay_step", "cfg_scale", "alg_temp") and value is not None and value < 0:
        return f"{option} must be >= 0, got {value}"
    if key == "eps" and not 0 < value < 1:
        return f"{option} must lie in (0, 1), got {value}"
    if key == "top_k" and value < -1:
        return f"{option} must be a positive integer (0 or -1: no top-k filter), got {value}"
    if key == "top_p" and not 0 < value <= 1:
        return f"{option} must lie in (0, 1] (1: no top-p filter), got {value}"
    return None


SERVER = "--additional-config dllm: "  # message prefix of server-wide options


def llada_has_no_filter(key: str, value: Any) -> str:
    return (
        f"'{key}'={value} is not supported for LLaDA: its reference decoding has no "
        f"top-k/top-p filter (leave '{key}' unset)"
    )


def _unknown_key(kind: str, key: str, prefix: str) -> str:
    """One sentence for a key the model kind does not know, with what it does know."""
    owners = [KIND_NAMES[k] for k, keys in _REQUEST_KEYS.items() if k != kind and key in keys]
    hint = f" ('{key}' is a {owners[0]} option)" if owners else ""
    known = ", ".join(sorted(_REQUEST_KEYS[kind]))
    return f"{prefix}unknown diffusion option '{key}' for {kind} models{hint}; {KIND_NAMES[kind]} options are {known}"


def check_overrides(kind: str, values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Type- and range-check a dict of option overrides for one model kind.

    `prefix` starts every message and names where the options were set: "" for a
    request's extra_args / vllm_xargs, SERVER for --additional-config."""
    if not isinstance(values, dict):
        raise OptionError(f"{prefix}the diffusion options must be a JSON object, got {type(values).__name__}")
    allowed = _REQUEST_KEYS[kind]
    for key, value in values.items():
        if key in _SAMPLING_PARAM_FIELDS and key not in allowed:
            if kind == LLADA and key in DREAM_FILTER_KEYS:
                raise OptionError(prefix + llada_has_no_filter(key, value))
            raise OptionError(
                f"{prefix}'{key}' is a standard sampling parameter: set it as "
                f"'{key}' on the request, not in the diffusion options"
            )
        if key not in allowed:
            raise OptionError(_unknown_key(kind, key, prefix))
        _check_type(key, value, allowed[key], prefix)
        problem = _range_problem(key, value, prefix)
        if problem:
            raise OptionError(problem)
    return dict(values)


def defaults_from_generation_config(kind: str, gen_config: dict[str, Any]) -> dict:
    """The decoding knobs a model's generation_config.json carries.

    Values we cannot use are skipped rather than refused: a checkpoint's file should
    not make the model unservable; the server and the request can still set them.
    """
    keys = _REQUEST_KEYS[kind]
    out = {}
    for key in keys:
        value = gen_config.get(key)
        if value is None:
            continue
        try:
            _check_type(key, value, keys[key])
        except OptionError:
            continue
        if _range_problem(key, value) is None:
            out[key] = value
    return out


def _positive_int(name: str, value: int) -> int:
    if value <= 0:
        raise OptionError(f"'{name}' must be a positive integer, got {value}")
    return value


def check_cache_knobs(merged: dict[str, Any], given: dict[str, Any], prefix: str) -> None:
    """refresh_interval and delay_step shape a KV cache, retention, pool_kernel and
    selection a sparse one; without one they would be silently ignored.  Only values
    set at this level are refused, so a request that turns the cache off is not
    blamed for the server's cache defaults."""
    cache = merged["cache"]
    if cache == "none":
        for key in ("refresh_interval", "delay_step"):
            if given.get(key):
                raise OptionError(
                    f"{prefix}diffusion option '{key}'={given[key]} only applies with a KV cache, "
                    f"but 'cache' is 'none'; set 'cache' to {_one_of(CACHE_POLICIES[1:])}, or drop '{key}'"
                )
    if cache != "sparse":
        for key in SPARSE_KEYS:
            if key in given:
                raise OptionError(
                    f"{prefix}diffusion option '{key}'={given[key]!r} only applies with cache 'sparse', "
                    f"but 'cache' is '{cache}'"
                )


def _delay_step(merged: dict[str, Any], steps_per_block: int) -> int:
    """The delayed update's steps: as set, else 1 for sparse (Sparse-dLLM's default,
    where a block has a second step to delay to) and 0 for the other policies."""
    if merged["delay_step"] is not None:
        return merged["delay_step"]
    return 1 if merged["cache"] == "sparse" and steps_per_block > 1 else 0


def _cache_options(merged: dict[str, Any], delay_step: int) -> dict[str, Any]:
    return dict(
        cache=merged["cache"],
        refresh_interval=merged["refresh_interval"],
        delay_step=delay_step,
        retention=float(merged["retention"]),
        pool_kernel=merged["pool_kernel"],
        selection=merged["selection"],
        scoring=merged["scoring"],
    )


# The rules that read each parallel decoding parameter (max_tokens_per_step: all of them).
DECODING_PARAMETERS = {
    "threshold": ("threshold", "hierarchy", "credit"),
    "low_threshold": ("hierarchy",),
    "credit_alpha": ("credit",),
    "credit_decay": ("credit",),
    "credit_boost": ("credit",),
    "factor": ("factor",),
    "gamma": ("entropy_bound",),
}


def _check_decoding(merged: dict[str, Any], given: dict[str, Any], prefix: str) -> None:
    """A rule's parameter without that rule, or a parallel rule with random
    remasking (whose 'confidences' are uniform draws), would be silently ignored or
    meaningless.  As for the cache knobs, only values set at this level are refused."""
    rule = merged["decoding"]
    for parameter, rules in DECODING_PARAMETERS.items():
        if parameter in given and rule not in rules:
            raise OptionError(
                f"{prefix}diffusion option '{parameter}' only applies with decoding {_one_of(tuple(map(repr, rules)))}, "
                f"but 'decoding' is '{rule}'"
            )
    if rule == "hierarchy" and merged["low_threshold"] > merged["threshold"]:
        raise OptionError(
            f"{prefix}diffusion option 'low_threshold'={merged['low_threshold']} must not exceed "
            f"'threshold'={merged['threshold']} (decoding 'hierarchy')"
        )
    if "max_tokens_per_step" in given and rule == "fixed":
        raise OptionError(
            f"{prefix}diffusion option 'max_tokens_per_step' only applies with a parallel decoding rule "
            f"({_one_of(DECODING_RULES[1:])}), but 'decoding' is 'fixed'"
        )
    if rule == "fixed":
        return
    # Settings whose ranking is not the model's confidence.
    if merged.get("remasking") == "random":
        clash = "remasking 'random'"
    elif merged.get("alg") == "origin":
        clash = "alg 'origin' (it unmasks random positions); use maskgit_plus, topk_margin or entropy"
    elif merged.get("alg_temp"):
        clash = "alg_temp (it draws positions at random)"
    else:
        return
    raise OptionError(
        f"{prefix}decoding '{rule}' ranks positions by the model's confidence; it cannot be combined with {clash}"
    )


def _block_length(merged: dict[str, Any], request: dict[str, Any], gen_length: int, steps: int) -> tuple[int, int]:
    """The canvas's block length and the delayed update's steps, checked against the
    generation length and the steps.  An unset block length that does not divide the
    generation falls back to one block: the request did not ask for
    semi-autoregressive decoding."""
    block_length = merged.get("block_length", gen_length)
    if "block_length" not in request and gen_length % block_length:
        block_length = gen_length
    if gen_length % block_length:
        raise OptionError(
            f"generation length (max_tokens={gen_length}) must be a multiple "
            f"of block_length={block_length}"
        )
    num_blocks = gen_length // block_length
    if steps % num_blocks:
        raise OptionError(
            f"steps={steps} must be divisible by the number of blocks "
            f"({num_blocks} = max_tokens {gen_length} / block_length {block_length})"
        )
    delay_step = _delay_step(merged, steps // num_blocks)
    if delay_step >= steps // num_blocks:
        raise OptionError(
            f"delay_step={delay_step} must be smaller than the steps per block "
            f"({steps // num_blocks})"
        )
    return block_length, delay_step


def _parallel_options(merged: dict[str, Any]) -> dict[str, Any]:
    """The parallel-decoding fields, typed as ParallelDecodingOptions declares them."""
    return {
        name: value if isinstance(default, str) else type(default)(value)
        for name, default in PARALLEL_DEFAULTS.items()
        for value in (merged[name],)
    }


def _dream_filter(key: str, request: dict, field: float, defaults: "ServerDefaults") -> Any:
    """A Dream top_k / top_p value: the request's extra_args, else vLLM's field (not
    neutral only at temperature > 0: vLLM resets it below 1e-5), else the server's
    default (generation_config.json / --override-generation-config)."""
    if key in request:
        return request[key]
    if is_filter(key, field):
        return field
    return defaults.overrides.get(key)


def resolve(
    defaults: "ServerDefaults",
    *,
    max_tokens: int | None,
    temperature: float,
    top_p: float,
    top_k: int,
    extra_args: dict[str, Any] | None,
) -> DecodeOptions:
    """Resolve and validate one request's decoding options."""
    kind = defaults.kind
    if max_tokens is None:
        raise OptionError("'max_tokens' (the generation length) must be set")
    gen_length = _positive_int("max_tokens", max_tokens)
    if temperature < 0:
        raise OptionError(f"'temperature' must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise OptionError(f"'top_p' must lie in (0, 1], got {top_p}")
    request = check_overrides(kind, extra_args or {})
    merged = {**defaults.overrides, **request}
    steps = _positive_int("steps", merged.get("steps", gen_length))

    if kind == LLADA:
        for name, value in (("top_k", top_k), ("top_p", top_p)):
            if is_filter(name, value):
                raise OptionError(llada_has_no_filter(name, value))
        if steps > gen_length:
            if "steps" in request:
                # LLaDA commits at least one token per step while masks remain, so the
                # steps beyond the canvas would commit nothing.
                raise OptionError(
                    f"steps={steps} is more than the generation length (max_tokens={gen_length}, "
                    f"after vLLM caps it at max_model_len minus the prompt): LLaDA commits at least "
                    f"one token per step, so use at most {gen_length} steps"
                )
            steps = gen_length  # a server/generation_config default: the same tokens
        check_cache_knobs(merged, request, "")
        _check_decoding(merged, request, "")
        block_length, delay_step = _block_length(merged, request, gen_length, steps)
        return LLaDAOptions(
            **_cache_options(merged, delay_step),
            **_parallel_options(merged),
            gen_length=gen_length,
            steps=steps,
            block_length=block_length,
            remasking=merged["remasking"],
            temperature=float(temperature),
            cfg_scale=float(merged["cfg_scale"]),
            logits_eos_inf=bool(merged["logits_eos_inf"]),
            confidence_eos_eot_inf=bool(merged["confidence_eos_eot_inf"]),
        )

    if steps > MAX_STEPS_PER_TOKEN * gen_length:
        # Dream's schedule may unmask nothing on some steps, so steps may exceed the
        # canvas (as in its reference), within a bound on the work.
        raise OptionError(
            f"steps={steps} is more than {MAX_STEPS_PER_TOKEN} per generated token "
            f"(max_tokens={gen_length})"
        )
    check_cache_knobs(merged, request, "")
    _check_decoding(merged, request, "")
    block_length, delay_step = _block_length(merged, request, gen_length, steps)
    alg_temp = merged.get("alg_temp")
    dream_top_k = _dream_filter("top_k", request, top_k, defaults)
    dream_top_p = _dream_filter("top_p", request, top_p, defaults)
    return DreamOptions(
        gen_length=gen_length,
        steps=steps,
        eps=float(merged["eps"]),
        alg=merged["alg"],
        alg_temp=float(alg_temp) if alg_temp else None,
        temperature=float(temperature),
        # vLLM's "off" values (top_p 1, top_k 0 or -1) mean the filter is not applied.
        top_p=None if dream_top_p is None or dream_top_p >= 1 else float(dream_top_p),
        top_k=dream_top_k if dream_top_k is not None and dream_top_k > 0 else None,
        block_length=block_length,
        **_cache_options(merged, delay_step),
        **_parallel_options(merged),
    )


def sequence_copies(options: DecodeOptions) -> int:
    """How many sequences one step of the request runs (2 with CFG)."""
    return 2 if options.uses_cfg else 1
