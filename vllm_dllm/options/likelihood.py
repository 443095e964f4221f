"""The per-request likelihood option: the models' own Monte-Carlo ELBO of a prompt's
continuation (`vllm_xargs {"likelihood": "elbo", "context_tokens": N, ...}`).

A request that asks scores log p(prompt[N:] | prompt[:N]) by its model's published
evaluation recipe (decoding/elbo.py) beside whatever it generates; the value and its
standard error come back with its final response.  These keys are request-only (no
server default: an estimate is asked for, not configured) and are no decoding
option, so `resolve` never sees them (`decoding_args`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from vllm_dllm.options.common import OptionError

LIKELIHOOD_KEYS = ("likelihood", "context_tokens", "mc_samples", "mc_batch")
ESTIMATORS = ("elbo",)
# Both official evaluations (LLaDA's eval_llada.py, Dream's eval/eval.py) draw 128
# masked samples by default, 32 per batch (LLaDA's batch_size default; the batch
# size of Dream's published eval_dream_mc.sh).  The batch matters: its samples
# share one stratified draw of mask ratios.
DEFAULT_MC_SAMPLES = 128
DEFAULT_MC_BATCH = 32
MAX_MC_SAMPLES = 4096
# The evaluation recipe of each model kind (decoding/elbo.py); LLaDA2's block
# diffusion publishes none.
RECIPE_OF_KIND = {"llada": "llada", "dream": "dream"}


@dataclass(frozen=True)
class LikelihoodRequest:
    estimator: str
    context_tokens: int  # the prompt's first N tokens are given, the rest scored
    mc_samples: int
    mc_batch: int  # samples per stratified batch; divides mc_samples


def decoding_args(extra_args: dict[str, Any] | None) -> dict[str, Any]:
    """The request's diffusion options without the likelihood keys."""
    if not isinstance(extra_args, dict):
        return extra_args or {}
    return {k: v for k, v in extra_args.items() if k not in LIKELIHOOD_KEYS}


def _count(key: str, value: Any, low: int, high: int | None = None) -> int:
    if type(value) is not int:
        raise OptionError(f"'{key}' must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f">= {low}"
        raise OptionError(f"'{key}' must be {bound}, got {value}")
    return value


def likelihood_request(extra_args: dict[str, Any] | None) -> LikelihoodRequest | None:
    """The request's likelihood option, checked; None when it asks for none."""
    if not isinstance(extra_args, dict):
        return None
    given = {k: extra_args[k] for k in LIKELIHOOD_KEYS if k in extra_args}
    if not given:
        return None
    estimator = given.get("likelihood")
    if estimator is None:
        keys = ", ".join(f"'{k}'" for k in given)
        raise OptionError(f"{keys} only apply with 'likelihood': 'elbo'")
    if estimator not in ESTIMATORS:
        raise OptionError(f"'likelihood' must be one of {', '.join(ESTIMATORS)}, got {estimator!r}")
    if "context_tokens" not in given:
        raise OptionError("'likelihood' needs 'context_tokens': the number of leading prompt tokens "
                          "the scored continuation is conditioned on")
    context = _count("context_tokens", given["context_tokens"], 0)
    samples = _count("mc_samples", given.get("mc_samples", DEFAULT_MC_SAMPLES), 1, MAX_MC_SAMPLES)
    # Unless asked, the official batch of 32, or the largest that divides the samples.
    batch = _count("mc_batch", given.get("mc_batch", math.gcd(DEFAULT_MC_BATCH, samples)), 1, samples)
    if samples % batch:
        raise OptionError(f"'mc_batch' ({batch}) must divide 'mc_samples' ({samples})")
    return LikelihoodRequest(estimator, context, samples, batch)


def model_problem(kind: str) -> str | None:
    """Why a model of this kind cannot estimate a likelihood, or None."""
    if kind in RECIPE_OF_KIND:
        return None
    return ("'likelihood': 'elbo' follows LLaDA's and Dream's evaluation recipes; block-diffusion "
            "(LLaDA2) models have none")


def prompt_problem(request: LikelihoodRequest, prompt_len: int) -> str | None:
    """Why this prompt cannot be scored as asked, or None."""
    if request.context_tokens >= prompt_len:
        return (f"'context_tokens' ({request.context_tokens}) must be less than the prompt's "
                f"{prompt_len} tokens: the continuation to score is the rest of the prompt")
    return None
