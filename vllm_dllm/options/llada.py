"""LLaDA's diffusion options: its request keys, the paper's defaults, and how a
request resolves into LLaDAOptions (semi-autoregressive blocks, low-confidence or
random remasking, classifier-free guidance; no top-k/top-p filter)."""

from __future__ import annotations

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
from vllm_dllm.options.smoothing import (
    SMOOTH_DEFAULTS,
    SMOOTH_KEYS,
    IterSmoothOptions,
    smooth_options,
    smooth_range_problem,
)

LLADA = "llada"

LLADA_REMASKING = ("low_confidence", "random")


@dataclass(frozen=True)
class LLaDAOptions(CanvasPlacement, KVCacheOptions, ParallelDecodingOptions, IterSmoothOptions):
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


# Per-request keys and their accepted types.
LLADA_KEYS: dict[str, tuple[type, ...]] = {
    "steps": (int,),
    "block_length": (int,),
    "remasking": (str,),
    "cfg_scale": (int, float),
    "logits_eos_inf": (bool,),
    "confidence_eos_eot_inf": (bool,),
    **_CACHE_KEYS,
    **_PARALLEL_KEYS,
    **SMOOTH_KEYS,
}

LLADA_DEFAULTS: dict[str, Any] = {
    "block_length": 32,
    "remasking": "low_confidence",
    "cfg_scale": 0.0,
    "logits_eos_inf": False,
    "confidence_eos_eot_inf": False,
    **CACHE_DEFAULTS,
    **PARALLEL_DEFAULTS,
    **SMOOTH_DEFAULTS,
}


def llada_has_no_filter(key: str, value: Any) -> str:
    return (
        f"'{key}'={value} is not supported for LLaDA: its reference decoding has no "
        f"top-k/top-p filter (leave '{key}' unset)"
    )


def _sampling_field_problem(key: str, value: Any) -> str | None:
    """LLaDA's refusal of vLLM's top_k / top_p set in the diffusion options."""
    return llada_has_no_filter(key, value) if key in FILTER_KEYS else None


def _llada_range_problem(key: str, value: Any, prefix: str = "") -> str | None:
    """LLaDA's own keys' ranges (after common._range_problem's shared checks)."""
    if key == "remasking" and value not in LLADA_REMASKING:
        return f"{prefix}unknown remasking '{value}': diffusion option 'remasking' must be {_one_of(LLADA_REMASKING)}"
    if key == "cfg_scale" and value is not None and value < 0:
        return f"{prefix}diffusion option '{key}' must be >= 0, got {value}"
    return smooth_range_problem(key, value, prefix)


def resolve_llada(r: ResolveInput) -> LLaDAOptions:
    """A request's LLaDAOptions, after the checks every family shares."""
    for name, value in (("top_k", r.top_k), ("top_p", r.top_p)):
        if is_filter(name, value):
            raise OptionError(llada_has_no_filter(name, value))
    merged, request, gen_length, steps = r.merged, r.given, r.gen_length, r.steps
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
    # Random remasking's 'confidences' are uniform draws.
    _check_decoding(merged, request, "", "remasking 'random'" if merged.get("remasking") == "random" else None)
    block_length, steps, delay_step = _block_length(merged, request, gen_length, steps)
    return LLaDAOptions(
        **_cache_options(merged, delay_step),
        **_parallel_options(merged),
        **smooth_options(merged, request),
        gen_length=gen_length,
        steps=steps,
        block_length=block_length,
        remasking=merged["remasking"],
        temperature=float(r.temperature),
        cfg_scale=float(merged["cfg_scale"]),
        logits_eos_inf=bool(merged["logits_eos_inf"]),
        confidence_eos_eot_inf=bool(merged["confidence_eos_eot_inf"]),
    )


KIND = DecodingKind(
    kind=LLADA,
    name="LLaDA",
    request_keys=LLADA_KEYS,
    paper_defaults=LLADA_DEFAULTS,
    resolve=resolve_llada,
    range_problem=_llada_range_problem,
    sampling_field_problem=_sampling_field_problem,
)
