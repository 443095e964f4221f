"""IterSmooth's per-request options (dInfer, Ma et al. 2025: inclusionAI/dInfer,
python/dinfer/decoding/generate_uniform.py, IterationSmooth).

A still-masked position's input at the next step is the mask's embedding plus
w * E[embedding] under the distribution the model gave it this step, w growing from
SMOOTH_WEIGHT_START by SMOOTH_WEIGHT_GROWTH per step of the request up to
`smooth_weight`; under a parallel rule with a threshold, the threshold starts at 1
and falls by SMOOTH_THRESHOLD_DECAY per step to the request's own.  Off by default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_dllm.options.common import DECODING_PARAMETERS, OptionError, _one_of

# dInfer's IterationSmooth defaults (cont_weight_init, cont_weight_growth).
SMOOTH_WEIGHT_START = 0.15
SMOOTH_WEIGHT_GROWTH = 0.02


@dataclass(frozen=True, kw_only=True)
class IterSmoothOptions:
    """`iter_smooth`: feed each still-masked position's expected embedding back;
    `smooth_weight`: the most weight that embedding reaches (dInfer's cont_weight);
    `smooth_threshold_decay`: how fast a parallel rule's threshold falls from 1 to
    its own (dInfer's threshold_decay; 0: the rule's threshold from the start)."""

    iter_smooth: bool = False
    smooth_weight: float = 0.3
    smooth_threshold_decay: float = 0.02


SMOOTH_KEYS: dict[str, tuple[type, ...]] = {
    "iter_smooth": (bool,), "smooth_weight": (int, float), "smooth_threshold_decay": (int, float),
}
SMOOTH_DEFAULTS: dict[str, Any] = {"iter_smooth": False, "smooth_weight": 0.3, "smooth_threshold_decay": 0.02}


def smooth_range_problem(key: str, value: Any, prefix: str = "") -> str | None:
    if key == "smooth_weight" and not 0 < value <= 1:
        return f"{prefix}diffusion option 'smooth_weight' must lie in (0, 1], got {value}"
    if key == "smooth_threshold_decay" and not 0 <= value <= 1:
        return f"{prefix}diffusion option 'smooth_threshold_decay' must lie in [0, 1], got {value}"
    return None


def smooth_options(merged: dict[str, Any], given: dict[str, Any], prefix: str = "",
                   threshold_rules: tuple[str, ...] = DECODING_PARAMETERS["threshold"]) -> dict[str, Any]:
    """The IterSmooth fields; a smoothing knob set at this level without smoothing
    (or the threshold's decay without a rule that reads a threshold,
    `threshold_rules`) would be silently ignored, so it is refused."""
    for key in ("smooth_weight", "smooth_threshold_decay"):
        if key in given and not merged["iter_smooth"]:
            raise OptionError(f"{prefix}diffusion option '{key}'={given[key]} only applies with 'iter_smooth': true")
    if "smooth_threshold_decay" in given and merged["decoding"] not in threshold_rules:
        raise OptionError(
            f"{prefix}diffusion option 'smooth_threshold_decay' only applies with decoding "
            f"{_one_of(tuple(map(repr, threshold_rules)))}, but 'decoding' is '{merged['decoding']}'"
        )
    return {"iter_smooth": bool(merged["iter_smooth"]), "smooth_weight": float(merged["smooth_weight"]),
            "smooth_threshold_decay": float(merged["smooth_threshold_decay"])}


def smooth_weight_at(step, cap):
    """The weight of the expected embedding a request's step `step` (0-based, over
    the whole request) computes: min(start + growth * step, cap).  Works on numbers
    and on tensors alike."""
    weight = SMOOTH_WEIGHT_START + SMOOTH_WEIGHT_GROWTH * step
    return weight.clamp(max=cap) if hasattr(weight, "clamp") else min(weight, cap)
