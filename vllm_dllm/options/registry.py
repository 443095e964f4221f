"""The decoding kinds and what dispatches on them: checking overrides for a kind,
reading a model's generation_config.json, and resolving a request.

Precedence, lowest first: the papers' defaults (DecodingKind.paper_defaults), the model's
generation_config.json (defaults_from_generation_config), the server's
`--additional-config '{"dllm": {...}}'` (both merged into ServerDefaults.overrides),
the request's extra_args (resolve).

A decoding kind is the way a group of model families decodes (LLaDA-8B and LLaDA-MoE
share one); which families decode as which kind is vllm_dllm/families.py.  A new kind
is its module (the options dataclass, its keys, defaults and resolver, and a KIND
record: see llada.py) and one entry in KINDS below, plus its options class in the
DecodeOptions union.
"""

from __future__ import annotations

from typing import Any

from vllm_dllm.options import dream, llada, llada2
from vllm_dllm.options.common import (
    _SAMPLING_PARAM_FIELDS,
    DecodingKind,
    OptionError,
    ResolveInput,
    ServerSettings,
    _check_type,
    _positive_int,
    _range_problem,
)
from vllm_dllm.options.dream import DreamOptions
from vllm_dllm.options.likelihood import decoding_args
from vllm_dllm.options.llada import LLaDAOptions
from vllm_dllm.options.llada2 import LLaDA2Options

# kind -> its options record; the order is the order of the messages that name kinds.
KINDS: dict[str, DecodingKind] = {record.kind: record for record in (llada.KIND, dream.KIND, llada2.KIND)}

DecodeOptions = LLaDAOptions | DreamOptions | LLaDA2Options

# Per kind, the ids its official code uses when a checkpoint names none.
RELEASE_SPECIAL_IDS: dict[str, dict[str, int]] = {llada2.LLADA2: llada2.RELEASE_IDS}

# Views of the registry, by the names the rest of the code reads.
KIND_NAMES = {kind: family.name for kind, family in KINDS.items()}
PAPER_DEFAULTS: dict[str, dict[str, Any]] = {kind: family.paper_defaults for kind, family in KINDS.items()}
_REQUEST_KEYS: dict[str, dict[str, tuple[type, ...]]] = {
    kind: family.request_keys for kind, family in KINDS.items()
}


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
    family = KINDS[kind]
    allowed = family.request_keys
    for key, value in values.items():
        if key in _SAMPLING_PARAM_FIELDS and key not in allowed:
            problem = family.sampling_field_problem(key, value)
            if problem:
                raise OptionError(prefix + problem)
            raise OptionError(
                f"{prefix}'{key}' is a standard sampling parameter: set it as "
                f"'{key}' on the request, not in the diffusion options"
            )
        if key not in allowed:
            raise OptionError(_unknown_key(kind, key, prefix))
        _check_type(key, value, allowed[key], prefix)
        problem = _range_problem(key, value, prefix, family.range_problem, family.own_ranges)
        if problem:
            raise OptionError(problem)
    return dict(values)


def defaults_from_generation_config(kind: str, gen_config: dict[str, Any]) -> dict:
    """The decoding knobs a model's generation_config.json carries.

    Values we cannot use are skipped rather than refused: a checkpoint's file should
    not make the model unservable; the server and the request can still set them.
    """
    family = KINDS[kind]
    keys = family.request_keys
    out = {}
    for key in keys:
        value = gen_config.get(key)
        if value is None:
            continue
        try:
            _check_type(key, value, keys[key])
        except OptionError:
            continue
        if _range_problem(key, value, "", family.range_problem, family.own_ranges) is None:
            out[key] = value
    return out


def resolve(
    defaults: ServerSettings,
    *,
    max_tokens: int | None,
    temperature: float,
    top_p: float,
    top_k: int,
    extra_args: dict[str, Any] | None,
) -> DecodeOptions:
    """Resolve and validate one request's decoding options: the checks every family
    shares here, then the family's resolver (DecodingKind.resolve)."""
    kind = defaults.kind
    if max_tokens is None:
        raise OptionError("'max_tokens' (the generation length) must be set")
    gen_length = _positive_int("max_tokens", max_tokens)
    if temperature < 0:
        raise OptionError(f"'temperature' must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise OptionError(f"'top_p' must lie in (0, 1], got {top_p}")
    request = check_overrides(kind, decoding_args(extra_args))
    merged = {**defaults.overrides, **KINDS[kind].expand(request)}
    steps = _positive_int("steps", merged.get("steps", gen_length))
    return KINDS[kind].resolve(
        ResolveInput(
            gen_length=gen_length,
            steps=steps,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            given=request,
            merged=merged,
            server=defaults.overrides,
        )
    )


def resolve_params(defaults: ServerSettings, params) -> DecodeOptions:
    """`resolve` for a request's vLLM SamplingParams."""
    return resolve(defaults, max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                   top_k=params.top_k, extra_args=params.extra_args)
