"""Dream's diffusion options: its request keys, the paper's defaults, its top-k /
top-p filters, and how a request resolves into DreamOptions (Dream's unmasking
algorithms and schedule over the whole canvas, or over blocks with a KV cache)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_dllm.options.common import (
    CanvasPlacement,
    _CACHE_KEYS,
    _PARALLEL_KEYS,
    CACHE_DEFAULTS,
    FILTER_KEYS,
    PARALLEL_DEFAULTS,
    DecodingKind,
    KVCacheOptions,
    OptionError,
    ParallelDecodingOptions,
    ResolveInput,
    _block_length,
    _cache_options,
    _check_decoding,
    _one_of,
    _parallel_options,
    check_cache_knobs,
    is_filter,
)

DREAM = "dream"

DREAM_ALGS = ("origin", "maskgit_plus", "topk_margin", "entropy")
MAX_STEPS_PER_TOKEN = 8
MIN_ALG_TEMP = 1e-3


@dataclass(frozen=True)
class DreamOptions(CanvasPlacement, KVCacheOptions, ParallelDecodingOptions):
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


# Per-request keys and their accepted types.
DREAM_KEYS: dict[str, tuple[type, ...]] = {
    "steps": (int,),
    "eps": (int, float),
    "alg": (str,),
    "alg_temp": (int, float, type(None)),
    # vLLM resets its own top_k/top_p fields at temperature 0, but Dream's
    # reference still renormalises its confidences over the top-k/top-p set
    # there: extra_args is the route that survives (see resolve_dream()).
    "top_k": (int,),
    "top_p": (int, float),
    "block_length": (int,),
    **_CACHE_KEYS,
    **_PARALLEL_KEYS,
}

DREAM_DEFAULTS: dict[str, Any] = {
    "eps": 1e-3,
    "alg": "origin",
    "alg_temp": None,
    **CACHE_DEFAULTS,
    **PARALLEL_DEFAULTS,
}

# Dream keys that are vLLM sampling fields as well: server-wide defaults come from
# vLLM's own generation-config route, not from --additional-config.
DREAM_FILTER_KEYS = FILTER_KEYS


def _dream_range_problem(key: str, value: Any, prefix: str = "") -> str | None:
    """Dream's own keys' ranges (after common._range_problem's shared checks)."""
    option = f"{prefix}diffusion option '{key}'"
    if key == "alg_temp" and value is not None and 0 < value < MIN_ALG_TEMP:
        return f"{option} must be 0 or at least {MIN_ALG_TEMP}, got {value}"
    if key == "alg" and value not in DREAM_ALGS:
        return f"{prefix}unknown alg '{value}': diffusion option 'alg' must be {_one_of(DREAM_ALGS)}"
    if key == "alg_temp" and value is not None and value < 0:
        return f"{option} must be >= 0, got {value}"
    if key == "eps" and not 0 < value < 1:
        return f"{option} must lie in (0, 1), got {value}"
    if key == "top_k" and value < -1:
        return f"{option} must be a positive integer (0 or -1: no top-k filter), got {value}"
    if key == "top_p" and not 0 < value <= 1:
        return f"{option} must lie in (0, 1] (1: no top-p filter), got {value}"
    return None


def _dream_filter(key: str, request: dict, field: float, server: Mapping[str, Any]) -> Any:
    """A Dream top_k / top_p value: the request's extra_args, else vLLM's field (not
    neutral only at temperature > 0: vLLM resets it below 1e-5), else the server's
    default (generation_config.json / --override-generation-config)."""
    if key in request:
        return request[key]
    if is_filter(key, field):
        return field
    return server.get(key)


def _confidence_clash(merged: dict[str, Any]) -> str | None:
    """The settings that rank positions by something else than the model's confidence."""
    if merged.get("alg") == "origin":
        return "alg 'origin' (it unmasks random positions); use maskgit_plus, topk_margin or entropy"
    if merged.get("alg_temp"):
        return "alg_temp (it draws positions at random)"
    return None


def resolve_dream(r: ResolveInput) -> DreamOptions:
    """A request's DreamOptions, after the checks every family shares."""
    merged, request, gen_length, steps = r.merged, r.given, r.gen_length, r.steps
    if steps > MAX_STEPS_PER_TOKEN * gen_length:
        # Dream's schedule may unmask nothing on some steps, so steps may exceed the
        # canvas (as in its reference), within a bound on the work.
        if "steps" in request:
            raise OptionError(
                f"steps={steps} is more than {MAX_STEPS_PER_TOKEN} per generated token "
                f"(max_tokens={gen_length})"
            )
        # A server or generation_config default (Dream's release sets 512) meant for
        # long generations: a short one runs the most steps the bound allows.
        steps = MAX_STEPS_PER_TOKEN * gen_length
    check_cache_knobs(merged, request, "")
    _check_decoding(merged, request, "", _confidence_clash(merged))
    block_length, steps, delay_step = _block_length(merged, request, gen_length, steps)
    alg_temp = merged.get("alg_temp")
    dream_top_k = _dream_filter("top_k", request, r.top_k, r.server)
    dream_top_p = _dream_filter("top_p", request, r.top_p, r.server)
    return DreamOptions(
        gen_length=gen_length,
        steps=steps,
        eps=float(merged["eps"]),
        alg=merged["alg"],
        alg_temp=float(alg_temp) if alg_temp else None,
        temperature=float(r.temperature),
        # vLLM's "off" values (top_p 1, top_k 0 or -1) mean the filter is not applied.
        top_p=None if dream_top_p is None or dream_top_p >= 1 else float(dream_top_p),
        top_k=dream_top_k if dream_top_k is not None and dream_top_k > 0 else None,
        block_length=block_length,
        **_cache_options(merged, delay_step),
        **_parallel_options(merged),
    )


KIND = DecodingKind(
    kind=DREAM,
    name="Dream",
    request_keys=DREAM_KEYS,
    paper_defaults=DREAM_DEFAULTS,
    resolve=resolve_dream,
    range_problem=_dream_range_problem,
)
