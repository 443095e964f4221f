"""The Monte-Carlo ELBO of a continuation given its context, by each model's
published evaluation recipe: which positions each sample masks and how its
masked log-probabilities are weighted.  Pure: tensors in, tensors out.

A sample is a copy of the prompt (context then continuation, length P = N + L) with
some continuation positions masked; its value is weight x (sum over its masked
positions j of log p(x_j | the copy)); the estimate is the mean over samples.
Samples come in batches of `mc_batch` that share one stratified draw of mask ratios.

LLaDA (eval_llada.py `_forward_process` / `get_loglikelihood`): per batch draw
k ~ U{1..L}; sample i of the batch masks exactly l_i continuation positions,
l_i = round(linspace(k, k + (b - 1) L / b, b))_i wrapped into [1, L], chosen
uniformly; weight L / l_i.  The context is never masked.

Dream (eval/eval.py `_forward_process` / `_eval_target_nll_mc`, log_type `ftb`): per
batch draw u0 ~ U(0, 1); sample i has t_i = (u0 + i / b) mod 1 and
p_i = (1 - eps) t_i + eps (eps = 1e-3); each continuation position is masked
independently with probability p_i, except the sequence's first and last positions,
which the recipe always leaves unmasked (it assumes BOS / EOS there): a continuation's
last token is never scored.  Weight 1 / p_i.

Every draw is counter-based (decoding/philox.py), keyed by the request's seed, the
sample (or batch) index and the position, so a request's estimate does not depend on
what else shares the step.  The standard error treats the samples as independent,
which overstates it a little: the stratified ratios of a batch vary less than
independent ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vllm_dllm.decoding import philox

RECIPES = ("llada", "dream")
DREAM_EPS = 1e-3  # eval/eval.py's sampling_eps
# Philox streams (decoding/sampling.py numbers the decoding rules' streams 1-5).
ELBO_RATIOS = 6  # per batch: LLaDA's k, Dream's u0
ELBO_MASKS = 7  # per sample and position: which positions it masks


@dataclass(frozen=True)
class ElboSamples:
    masked: torch.Tensor  # bool [S, P]: the positions each sample masks
    weight: torch.Tensor  # float64 [S]: the factor on the sample's masked log-probs


def _seeds(seed: int, n: int) -> torch.Tensor:
    seed %= 1 << 64
    return torch.full((n,), seed - (1 << 64) if seed >= 1 << 63 else seed, dtype=torch.int64)


def _batch_uniforms(seed: int, batches: int, dtype: torch.dtype) -> torch.Tensor:
    return philox.uniform(_seeds(seed, batches), torch.arange(batches), torch.full((batches,), -1), ELBO_RATIOS,
                          dtype)


def _position_uniforms(seed: int, samples: int, prompt_len: int) -> torch.Tensor:
    return philox.uniform_rows(_seeds(seed, samples), torch.arange(samples), torch.full((samples,), -1),
                               ELBO_MASKS, prompt_len, torch.float64)


def llada_mask_counts(k: int, length: int, batch: int) -> torch.Tensor:
    """[batch] masked positions per sample of a batch whose draw is k (1 <= k <= L),
    computed as eval_llada.py does (float32 linspace, round half to even)."""
    x = torch.round(torch.linspace(float(k), k + (batch - 1) * (length / batch), steps=batch)).long()
    return ((x - 1) % length) + 1


def llada_samples(seed: int, prompt_len: int, context: int, samples: int, batch: int) -> ElboSamples:
    length = prompt_len - context
    ks = (_batch_uniforms(seed, samples // batch, torch.float64) * length).long() + 1
    counts = torch.cat([llada_mask_counts(int(k), length, batch) for k in ks.tolist()])
    u = _position_uniforms(seed, samples, prompt_len)[:, context:]
    # The `count` continuation positions with the smallest draws: a uniform choice.
    rank = torch.argsort(torch.argsort(u, dim=1, stable=True), dim=1)
    masked = torch.zeros(samples, prompt_len, dtype=torch.bool)
    masked[:, context:] = rank < counts[:, None]
    return ElboSamples(masked, length / counts.double())


def dream_samples(seed: int, prompt_len: int, context: int, samples: int, batch: int) -> ElboSamples:
    u0 = _batch_uniforms(seed, samples // batch, torch.float32)
    t = (u0[:, None] + torch.arange(batch, dtype=torch.float32) / batch) % 1
    p = ((1 - DREAM_EPS) * t + DREAM_EPS).reshape(-1)
    masked = _position_uniforms(seed, samples, prompt_len) < p.double()[:, None]
    masked[:, :context] = False
    masked[:, 0] = masked[:, -1] = False
    return ElboSamples(masked, 1.0 / p.double())


def draw_samples(recipe: str, seed: int, prompt_len: int, context: int, samples: int, batch: int) -> ElboSamples:
    if recipe == "llada":
        return llada_samples(seed, prompt_len, context, samples, batch)
    if recipe == "dream":
        return dream_samples(seed, prompt_len, context, samples, batch)
    raise ValueError(f"unknown ELBO recipe {recipe!r}; expected one of {', '.join(RECIPES)}")


def estimate(values: list[float] | torch.Tensor) -> tuple[float, float | None]:
    """(mean, standard error of the mean) of the samples' values; no error from one sample."""
    v = torch.as_tensor(values, dtype=torch.float64)
    mean = float(v.mean())
    if len(v) < 2:
        return mean, None
    return mean, float(v.std(unbiased=True)) / math.sqrt(len(v))
