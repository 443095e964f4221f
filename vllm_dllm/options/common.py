"""What every model family's diffusion options share: the error, type and range
checks, the KV-cache and parallel-decoding options and their checks, the canvas's
blocks, and the family record the registry (options/registry.py) is made of.

Pure, and independent of any one family: a family module (llada.py, dream.py)
builds its options from these pieces; nothing here names a family.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from vllm_dllm.options.sparse_defaults import SCORINGS, default_pool_kernel

CACHE_POLICIES = ("none", "prefix", "dual", "sparse", "vicinity")
# Positions a vicinity cache's Reuse steps also run on each side of the active block.
DEFAULT_VICINITY = 16
SPARSE_SELECTIONS = ("head", "uniform")  # see attention/sparse.py
SPARSE_SCORINGS = ("max", "mean", "weight")
MAX_POOL_KERNEL = 63  # the sparse selection's max-pool window (one op per offset)
DECODING_RULES = ("fixed", "threshold", "factor", "entropy_bound", "hierarchy", "credit")  # see decoding/parallel.py

SERVER = "--additional-config dllm: "  # message prefix of server-wide options


class OptionError(ValueError):
    """A diffusion option is missing, malformed or inconsistent."""


class ServerSettings(Protocol):
    """What resolving a request reads of the server-wide settings (ServerDefaults):
    the model kind and the options resolved over the papers' defaults."""

    @property
    def kind(self) -> str: ...

    @property
    def overrides(self) -> Mapping[str, Any]: ...


class UsesCfg(Protocol):
    """Any family's resolved options (DecodeOptions)."""

    @property
    def uses_cfg(self) -> bool: ...


class CanvasPlacement:
    """How a family's canvas sits after the prompt; these defaults: right after it,
    exactly `gen_length` positions, all of them output."""

    block_causal = False  # attention by blocks (phases.block_causal_phase)

    def placed(self, prompt_len: int):
        """These options for a prompt of `prompt_len` tokens."""
        return self

    @property
    def output_length(self) -> int:
        return self.gen_length

    @property
    def max_steps_per_block(self) -> int:
        """An upper bound on a block's steps under every rule (scheduler pricing)."""
        return self.steps_per_block


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
    the largest attention weight, or the mean query's) max-pooled over `pool_kernel`
    positions; `selection` uniform
    keeps one set shared by all heads.  `vicinity` (dInfer's Vicinity Refresh): the
    positions on each side of the active block a `vicinity` cache's Reuse steps also
    run, refreshing their K/V."""

    cache: str = "none"
    refresh_interval: int = 0
    delay_step: int = 0
    retention: float = 0.5
    pool_kernel: int = 3
    selection: str = "head"
    scoring: str = "max"
    vicinity: int = DEFAULT_VICINITY


PARALLEL_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ParallelDecodingOptions)}
# Request keys and their accepted types, as each family's table includes them.
# bool is checked before int because bool is a subclass of int in Python.
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
    "vicinity": (int,),
}
SPARSE_KEYS = ("retention", "pool_kernel", "selection", "scoring")

# delay_step None: the policy's own (Sparse-dLLM's one-step delayed update for sparse,
# none for prefix/dual as in Fast-dLLM); see _delay_step.
CACHE_DEFAULTS = {"cache": "none", "refresh_interval": 0, "delay_step": None,
                  "retention": 0.5, "pool_kernel": None, "selection": "head", "scoring": None,
                  "vicinity": DEFAULT_VICINITY}

# vLLM's own fields: naming them in extra_args would be ambiguous (unless a family
# takes one as its own key, as Dream does top_k / top_p).
_SAMPLING_PARAM_FIELDS = ("temperature", "top_p", "top_k", "seed", "max_tokens")
# vLLM's top-k / top-p sampling fields, and their "no filter" values.
FILTER_KEYS = ("top_k", "top_p")
NEUTRAL_TOP_K = (0, -1)
NEUTRAL_TOP_P = 1.0


def is_filter(key: str, value: Any) -> bool:
    """Whether a top_k / top_p value asks for a filter (vLLM's neutral values do not)."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return value not in NEUTRAL_TOP_K if key == "top_k" else value < NEUTRAL_TOP_P


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


def _one_of(choices: tuple[str, ...]) -> str:
    if len(choices) == 1:
        return choices[0]
    return ", ".join(choices[:-1]) + " or " + choices[-1]


RangeProblem = Callable[[str, Any, str], str | None]


def _no_range_problem(key: str, value: Any, prefix: str = "") -> str | None:
    return None


def _range_problem(key: str, value: Any, prefix: str = "", family: RangeProblem = _no_range_problem,
                   own: frozenset[str] = frozenset()) -> str | None:
    """Why a well-typed option value is out of range, as one sentence, or None.

    Checks the keys every family shares, then hands the rest, and the shared keys in
    `own` (DecodingKind.own_ranges), to `family` (the family's own range check,
    DecodingKind.range_problem).  `prefix` names where the option was set ("" for a request)."""
    option = f"{prefix}diffusion option '{key}'"
    if isinstance(value, float) and not math.isfinite(value):
        return f"{option} must be a finite number, got {value}"
    if key in own:
        return family(key, value, prefix)
    if key in ("steps", "block_length") and value <= 0:
        return f"{option} must be a positive integer, got {value}"
    # The value the user typed first, then what is allowed.
    if key == "cache" and value not in CACHE_POLICIES:
        return f"{prefix}unknown cache policy '{value}': diffusion option 'cache' must be {_one_of(CACHE_POLICIES)}"
    if key == "selection" and value not in SPARSE_SELECTIONS:
        return f"{prefix}unknown selection '{value}': diffusion option 'selection' must be {_one_of(SPARSE_SELECTIONS)}"
    if key == "scoring" and value not in SPARSE_SCORINGS:
        return f"{prefix}unknown scoring '{value}': diffusion option 'scoring' must be {_one_of(SPARSE_SCORINGS)}"
    if key == "retention" and not 0 < value <= 1:
        return f"{option} must lie in (0, 1], got {value}"
    if key == "pool_kernel" and value is not None and not (1 <= value <= MAX_POOL_KERNEL and value % 2 == 1):
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
    if key in ("refresh_interval", "delay_step", "vicinity") and value is not None and value < 0:
        return f"{option} must be >= 0, got {value}"
    return family(key, value, prefix)


def _positive_int(name: str, value: int) -> int:
    if value <= 0:
        raise OptionError(f"'{name}' must be a positive integer, got {value}")
    return value


def check_cache_knobs(merged: dict[str, Any], given: dict[str, Any], prefix: str) -> None:
    """refresh_interval and delay_step shape a KV cache, retention, pool_kernel and
    selection a sparse one; without one they would be silently ignored.  Only values
    set at this level are refused, so a request that turns the cache off is not
    blamed for the server's cache defaults."""
    if "cache" not in merged:
        return  # a family without KV-cache policies (block-causal attention)
    cache = merged["cache"]
    if cache == "none":
        for key in ("refresh_interval", "delay_step"):
            if given.get(key):
                raise OptionError(
                    f"{prefix}diffusion option '{key}'={given[key]} only applies with a KV cache, "
                    f"but 'cache' is 'none'; set 'cache' to {_one_of(CACHE_POLICIES[1:])}, or drop '{key}'"
                )
    for policy, keys in (("sparse", SPARSE_KEYS), ("vicinity", ("vicinity",))):
        for key in keys if cache != policy else ():
            if key in given:
                raise OptionError(f"{prefix}diffusion option '{key}'={given[key]!r} only applies with cache "
                                  f"'{policy}', but 'cache' is '{cache}'")


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
        pool_kernel=(merged["pool_kernel"] if merged["pool_kernel"] is not None
                     else default_pool_kernel(merged["selection"], float(merged["retention"]))),
        selection=merged["selection"],
        scoring=merged["scoring"] if merged["scoring"] is not None else SCORINGS[merged["selection"]],
        vicinity=merged["vicinity"],
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


def _check_decoding(merged: dict[str, Any], given: dict[str, Any], prefix: str, clash: str | None,
                    parameters: dict[str, tuple[str, ...]] = DECODING_PARAMETERS) -> None:
    """A rule's parameter without that rule, or a parallel rule with a family setting
    whose ranking is not the model's confidence (`clash`, as the family words it:
    LLaDA's random remasking, whose 'confidences' are uniform draws, say), would be
    silently ignored or meaningless.  As for the cache knobs, only values set at this
    level are refused.  `parameters`: the rules that read each parameter, where a
    family's own rule reads one too (LLaDA2's official rule reads `threshold`)."""
    rule = merged["decoding"]
    for parameter, rules in parameters.items():
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
    if rule == "fixed" or clash is None:
        return
    raise OptionError(
        f"{prefix}decoding '{rule}' ranks positions by the model's confidence; it cannot be combined with {clash}"
    )


def _block_length(merged: dict[str, Any], request: dict[str, Any], gen_length: int,
                  steps: int) -> tuple[int, int, int]:
    """The canvas's block length, the steps and the delayed update's steps, checked
    against the generation length.  An unset block length that does not divide the
    generation falls back to one block: the request did not ask for
    semi-autoregressive decoding.  Steps the request did not set (a server or
    generation_config default) that do not divide over its blocks are rounded up to
    a multiple of them: never fewer than configured, and within every bound (the
    generation length and 8 per token are multiples of the blocks)."""
    block_length = merged.get("block_length", gen_length)
    if "block_length" not in request and gen_length % block_length:
        block_length = gen_length
    if gen_length % block_length:
        raise OptionError(
            f"generation length (max_tokens={gen_length}, after vLLM caps it at max_model_len minus the "
            f"prompt) must be a multiple of block_length={block_length}"
        )
    num_blocks = gen_length // block_length
    if steps % num_blocks and "steps" not in request:
        steps += num_blocks - steps % num_blocks
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
    return block_length, steps, delay_step


def _parallel_options(merged: dict[str, Any]) -> dict[str, Any]:
    """The parallel-decoding fields, typed as ParallelDecodingOptions declares them."""
    return {
        name: value if isinstance(default, str) else type(default)(value)
        for name, default in PARALLEL_DEFAULTS.items()
        for value in (merged[name],)
    }


def sequence_copies(options: UsesCfg) -> int:
    """How many sequences one step of the request runs (2 with CFG)."""
    return 2 if options.uses_cfg else 1


@dataclass(frozen=True)
class ResolveInput:
    """One request as a family's resolver receives it, after the checks every family
    shares (registry.resolve): the generation length, the positive step count (the
    merged 'steps', else the generation length), vLLM's own sampling fields, the
    request's checked diffusion options, and those over the server's."""

    gen_length: int
    steps: int
    temperature: float
    top_p: float
    top_k: int
    given: dict[str, Any]  # the request's extra_args, checked
    merged: dict[str, Any]  # the server's overrides, then `given` over them
    server: Mapping[str, Any]  # the server's overrides (ServerSettings.overrides)


def _no_sampling_field_problem(key: str, value: Any) -> str | None:
    return None


@dataclass(frozen=True)
class DecodingKind:
    """One decoding kind's diffusion options: one entry of the registry (KINDS).

    `request_keys` are the diffusion options a request (or the server, or the
    model's generation_config.json) may set, with their accepted types;
    `paper_defaults` the values of those not set anywhere (steps excepted: the
    generation length); `resolve` turns a ResolveInput into the family's options.
    `range_problem` checks the family's own keys' values (after _range_problem's
    shared checks; same signature, returning None for keys it does not know), and
    `sampling_field_problem` may word the refusal of a vLLM sampling field the
    family does not take as a key (default: set it on the request)."""

    kind: str  # the model kind, as ServerDefaults.kind names it
    name: str  # for messages
    request_keys: dict[str, tuple[type, ...]]
    paper_defaults: dict[str, Any]
    resolve: Callable[[ResolveInput], Any]
    range_problem: RangeProblem = _no_range_problem
    # Shared keys whose range is the family's own (its reference accepts other values).
    own_ranges: frozenset[str] = frozenset()
    sampling_field_problem: Callable[[str, Any], str | None] = _no_sampling_field_problem
    # One level's options with shorthands spelled out (LLaDA2's modes), applied to each
    # level before it is merged over the one below.
    expand: Callable[[dict[str, Any]], dict[str, Any]] = dict
