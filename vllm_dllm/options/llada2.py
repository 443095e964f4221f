"""LLaDA2.x's diffusion options, named as the official `generate()` parameters.

LLaDA2.0 and 2.1 share the model type and architecture; token editing (2.1) is on
when `editing_threshold` is set, at any level, or a 2.1 mode is chosen: `quality`
(threshold 0.7, editing_threshold 0.5) or `speed` (threshold 0.5, editing_threshold
0.0), both with max_post_steps 16.  A mode stands for those three values at the level
that sets it (generation_config.json, the server, a request): keys set at the same
level win over it, and the next level wins over both.  Defaults otherwise: generation_config.json,
then the official function's (block_length 32, steps 32, threshold 0.95, ...).

Parallel decoding (`decoding` and its parameters, decoding/parallel.py) takes the
same keys, types and checks as on LLaDA, with one difference: `threshold` is already
the official rule's, so it is one key read by `fixed` (the official quota/threshold
choice), `threshold`, `hierarchy` and `credit`, with the official default 0.95 (or the
mode's), and refused at the level that sets it only with `factor` or `entropy_bound`.
The rules compose with 2.1's token editing (decoding/llada2.py says how and why).
IterSmooth (options/smoothing.py) takes the same keys as on LLaDA; its falling
threshold is the official rule's too.

The canvas is block-aligned (decoding/llada2.py): `placed(prompt_len)` fixes where
the prompt's partial last block leaves the first generated position.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from vllm_dllm.options.common import (
    _PARALLEL_KEYS,
    DECODING_PARAMETERS,
    PARALLEL_DEFAULTS,
    CanvasPlacement,
    DecodingKind,
    KVCacheOptions,
    OptionError,
    ParallelDecodingOptions,
    ResolveInput,
    _check_decoding,
    _one_of,
    _parallel_options,
)
from vllm_dllm.options.smoothing import (
    SMOOTH_DEFAULTS,
    SMOOTH_KEYS,
    IterSmoothOptions,
    smooth_options,
    smooth_range_problem,
)

LLADA2 = "llada2"

# The official generate()'s ids, used only when neither the checkpoint's files nor
# its tokenizer name them (the released config.json has no mask id).
RELEASE_IDS = {"mask_token_id": 156895, "eos_token_id": 156892}

LLADA2_MODES: dict[str, dict[str, Any]] = {
    "quality": {"threshold": 0.7, "editing_threshold": 0.5, "max_post_steps": 16},
    "speed": {"threshold": 0.5, "editing_threshold": 0.0, "max_post_steps": 16},
}

# Post steps bound a block's steps (scheduler pricing walks every future step).
MAX_POST_STEPS = 256

LLADA2_KEYS: dict[str, tuple[type, ...]] = {
    "block_length": (int,),
    "steps": (int,),
    "threshold": (int, float),
    "minimal_topk": (int,),
    "eos_early_stop": (bool,),
    "editing_threshold": (int, float, type(None)),
    "max_post_steps": (int,),
    "num_to_transfer": (int,),
    "mode": (str,),
    **_PARALLEL_KEYS,  # threshold: the same (int, float) as above
    **SMOOTH_KEYS,
}

LLADA2_DEFAULTS: dict[str, Any] = {
    "block_length": 32,
    "steps": 32,
    "threshold": 0.95,
    "minimal_topk": 1,
    "eos_early_stop": False,
    "editing_threshold": None,
    "max_post_steps": 16,
    "num_to_transfer": 1,
    "mode": None,
    **{name: value for name, value in PARALLEL_DEFAULTS.items() if name != "threshold"},
    **SMOOTH_DEFAULTS,
}

# The rules that read each parallel decoding parameter: LLaDA's, and the official
# rule (`fixed`) reads `threshold` too.
LLADA2_DECODING_PARAMETERS = {**DECODING_PARAMETERS, "threshold": ("fixed", *DECODING_PARAMETERS["threshold"])}


@dataclass(frozen=True)
class LLaDA2Options(CanvasPlacement, KVCacheOptions, ParallelDecodingOptions, IterSmoothOptions):
    max_tokens: int
    block_length: int
    steps: int
    # The official rule's, and the parallel rules' that read one (ParallelDecodingOptions
    # declares it keyword-only; the default here is the official function's).
    threshold: float = dataclasses.field(default=LLADA2_DEFAULTS["threshold"], kw_only=True)
    minimal_topk: int
    eos_early_stop: bool  # the output is the same either way: a request ends at its first final EOS
    editing_threshold: float | None  # None: LLaDA2.0 decoding, no token editing
    max_post_steps: int
    num_to_transfer: int
    temperature: float
    top_k: int | None
    top_p: float | None
    lead: int = 0  # prompt length mod block_length (placed())

    block_causal = True

    def placed(self, prompt_len: int) -> "LLaDA2Options":
        return dataclasses.replace(self, lead=prompt_len % self.block_length)

    @property
    def num_blocks(self) -> int:
        return -(-(self.lead + self.max_tokens) // self.block_length)

    @property
    def gen_length(self) -> int:
        """Canvas positions: up to the end of the last block (denoised, not output)."""
        return self.num_blocks * self.block_length - self.lead

    @property
    def output_length(self) -> int:
        return self.max_tokens

    @property
    def steps_per_block(self) -> int:
        return max(1, min(self.steps, self.max_tokens // self.minimal_topk))

    @property
    def max_steps_per_block(self) -> int:
        if self.editing_threshold is None:
            # The quota commits at least one mask a step for the first block_length steps.
            return min(self.steps_per_block, self.block_length)
        # A step commits at least one mask while any remain, then post steps follow.
        return -(-self.block_length // self.num_to_transfer) + self.max_post_steps + 1

    @property
    def uses_cfg(self) -> bool:
        return False


# LLaDA2.2 (Levenshtein editing: DELETE / SPLIT tokens, block routing of experts)
# keeps the architecture and model type; its config names the edit tokens.
LLADA22_CONFIG_KEYS = ("delete_token_id", "split_token_id")


def unsupported_release(hf_config) -> str | None:
    """Why a llada2_moe checkpoint cannot be served exactly, or None."""
    found = [key for key in LLADA22_CONFIG_KEYS if getattr(hf_config, key, None) is not None]
    if found:
        return (
            f"this looks like a LLaDA2.2 checkpoint (config.json sets {', '.join(found)}): its decoding "
            "(Levenshtein editing with DELETE/SPLIT tokens) and its per-block expert routing are not "
            "supported yet (docs/llada2.2.md); LLaDA2.0 and LLaDA2.1 checkpoints are"
        )
    return None


def _range_problem(key: str, value: Any, prefix: str = "") -> str | None:
    option = f"{prefix}diffusion option '{key}'"
    if key == "editing_threshold" and value is not None and not 0 <= value <= 1:
        return f"{option} must lie in [0, 1], got {value}"
    if key in ("minimal_topk", "num_to_transfer") and value < 1:
        return f"{option} must be a positive integer, got {value}"
    if key == "max_post_steps" and not 0 <= value <= MAX_POST_STEPS:
        return f"{option} must lie in [0, {MAX_POST_STEPS}], got {value}"
    if key == "mode" and value not in LLADA2_MODES:
        return f"{prefix}unknown mode '{value}': diffusion option 'mode' must be {_one_of(tuple(LLADA2_MODES))}"
    return smooth_range_problem(key, value, prefix)


def expand_mode(level: dict[str, Any]) -> dict[str, Any]:
    """One level's options (generation_config.json, the server's, a request's) with its
    mode spelled out: the mode's values, then the keys the level sets itself."""
    mode = level.get("mode")
    return {**LLADA2_MODES[mode], **level} if mode in LLADA2_MODES else dict(level)


def resolve_llada2(r: ResolveInput) -> LLaDA2Options:
    merged = r.merged
    block_length = merged["block_length"]
    if r.gen_length < merged["minimal_topk"]:
        raise OptionError(
            f"minimal_topk={merged['minimal_topk']} is more than the generation length (max_tokens={r.gen_length})"
        )
    # Only what the request sets is refused: a mode's threshold is not blamed.
    _check_decoding(merged, r.given, "", None, LLADA2_DECODING_PARAMETERS)
    editing = merged["editing_threshold"]
    return LLaDA2Options(
        **{name: value for name, value in _parallel_options(merged).items() if name != "threshold"},
        **smooth_options(merged, r.given, threshold_rules=LLADA2_DECODING_PARAMETERS["threshold"]),
        max_tokens=r.gen_length,
        block_length=block_length,
        steps=r.steps,
        threshold=float(merged["threshold"]),
        minimal_topk=merged["minimal_topk"],
        eos_early_stop=bool(merged["eos_early_stop"]),
        editing_threshold=None if editing is None else float(editing),
        max_post_steps=merged["max_post_steps"],
        num_to_transfer=merged["num_to_transfer"],
        temperature=float(r.temperature),
        # vLLM's "off" values (top_k 0 or -1, top_p 1) mean no filter.
        top_k=r.top_k if r.top_k > 0 else None,
        top_p=r.top_p if r.top_p < 1 else None,
    )


KIND = DecodingKind(
    kind=LLADA2,
    name="LLaDA2",
    request_keys=LLADA2_KEYS,
    paper_defaults=LLADA2_DEFAULTS,
    resolve=resolve_llada2,
    range_problem=_range_problem,
    # The official generate() compares confidences with any threshold: at or below 0
    # every masked position of the block commits at once, above 1 the quota alone decides.
    own_ranges=frozenset({"threshold"}),
    expand=expand_mode,
)
