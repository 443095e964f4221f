"""The ELBO option and its mask schedules, without an engine: what a request may
ask (options/likelihood.py) and which positions each Monte-Carlo sample masks with
what weight (decoding/elbo.py), against the recipes of LLaDA's eval_llada.py and
Dream's eval/eval.py written out here from their definitions.  The estimates
themselves are checked through the engine in tests/engine/test_logprobs.py."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_dllm.decoding.elbo import DREAM_EPS, draw_samples, estimate, llada_mask_counts
from vllm_dllm.options import OptionError
from vllm_dllm.options.likelihood import (
    LikelihoodRequest,
    decoding_args,
    likelihood_request,
    model_problem,
    prompt_problem,
)


def test_a_request_without_the_keys_asks_for_nothing():
    assert likelihood_request(None) is None
    assert likelihood_request({"steps": 8}) is None
    assert decoding_args({"steps": 8, "likelihood": "elbo", "context_tokens": 3, "mc_samples": 4}) == {"steps": 8}


def test_defaults_follow_the_official_evaluations():
    assert likelihood_request({"likelihood": "elbo", "context_tokens": 5}) == LikelihoodRequest("elbo", 5, 128, 32)
    # Fewer samples than LLaDA's batch of 32: one batch of them all; a count 32 does not
    # divide: the largest batch that does.
    assert likelihood_request({"likelihood": "elbo", "context_tokens": 0, "mc_samples": 8}).mc_batch == 8
    assert likelihood_request({"likelihood": "elbo", "context_tokens": 0, "mc_samples": 100}).mc_batch == 4
    assert likelihood_request({"likelihood": "elbo", "context_tokens": 0, "mc_samples": 96}).mc_batch == 32
    assert likelihood_request({"likelihood": "elbo", "context_tokens": 2, "mc_samples": 12,
                               "mc_batch": 4}) == LikelihoodRequest("elbo", 2, 12, 4)


@pytest.mark.parametrize("args, words", [
    ({"context_tokens": 3}, "only apply with 'likelihood'"),
    ({"likelihood": "chain", "context_tokens": 3}, "'likelihood' must be one of elbo"),
    ({"likelihood": "elbo"}, "needs 'context_tokens'"),
    ({"likelihood": "elbo", "context_tokens": -1}, "'context_tokens' must be >= 0"),
    ({"likelihood": "elbo", "context_tokens": 2.5}, "'context_tokens' must be an integer"),
    ({"likelihood": "elbo", "context_tokens": 2, "mc_samples": 0}, "'mc_samples' must be between 1 and 4096"),
    ({"likelihood": "elbo", "context_tokens": 2, "mc_samples": True}, "'mc_samples' must be an integer"),
    ({"likelihood": "elbo", "context_tokens": 2, "mc_samples": 12, "mc_batch": 5}, "must divide 'mc_samples' (12)"),
    ({"likelihood": "elbo", "context_tokens": 2, "mc_samples": 4, "mc_batch": 8}, "'mc_batch' must be between 1 and 4"),
])
def test_bad_values_are_named(args, words):
    with pytest.raises(OptionError) as err:
        likelihood_request(args)
    assert words in str(err.value)


def test_what_cannot_be_scored_is_named():
    request = likelihood_request({"likelihood": "elbo", "context_tokens": 6})
    assert "must be less than the prompt's 6 tokens" in prompt_problem(request, 6)
    assert prompt_problem(request, 7) is None
    assert model_problem("llada") is None and model_problem("dream") is None
    assert "LLaDA2" in model_problem("llada2")


def official_llada_counts(k: int, length: int, batch: int) -> list[int]:
    """eval_llada.py's `_forward_process`: l = round(linspace(k, k + (b-1) L/b, b)),
    wrapped into [1, L]."""
    x = torch.round(torch.linspace(float(k), k + (batch - 1) * (length / batch), steps=batch)).long()
    return (((x - 1) % length) + 1).tolist()


@pytest.mark.parametrize("length, batch", [(1, 1), (5, 4), (7, 32), (16, 16), (40, 32)])
def test_llada_mask_counts_are_the_recipes(length, batch):
    for k in range(1, length + 1):
        counts = llada_mask_counts(k, length, batch).tolist()
        assert counts == official_llada_counts(k, length, batch)
        assert all(1 <= c <= length for c in counts)


def test_llada_samples_mask_exactly_their_count_of_the_continuation():
    prompt_len, context, samples, batch = 13, 5, 64, 16
    draw = draw_samples("llada", 7, prompt_len, context, samples, batch)
    length = prompt_len - context
    assert not draw.masked[:, :context].any()
    counts = draw.masked.sum(dim=1)
    assert torch.allclose(draw.weight, length / counts.double())
    # Each batch shares one k: its counts are the recipe's stratified spread.
    for b in range(samples // batch):
        got = counts[b * batch : (b + 1) * batch].tolist()
        assert any(got == official_llada_counts(k, length, batch) for k in range(1, length + 1))
    # The chosen positions vary from sample to sample (a uniform choice, not a prefix).
    assert len({tuple(row.tolist()) for row in draw.masked}) > samples // 2


def test_dream_samples_follow_the_recipe():
    prompt_len, context, samples, batch = 30, 6, 256, 32
    draw = draw_samples("dream", 3, prompt_len, context, samples, batch)
    assert not draw.masked[:, :context].any()
    assert not draw.masked[:, -1].any()  # the recipe never masks the sequence's last position
    p = 1 / draw.weight
    assert ((p >= DREAM_EPS) & (p <= 1)).all()
    for b in range(samples // batch):
        t = (p[b * batch : (b + 1) * batch] - DREAM_EPS) / (1 - DREAM_EPS)
        # t_i = (u0 + i / b) mod 1: consecutive samples a 1/b apart, modulo 1.
        steps = (t.roll(-1) - t)[:-1] % 1
        assert torch.allclose(steps, torch.full_like(steps, 1 / batch), atol=1e-5)
    # Each position is masked with the sample's probability: the masked fraction of
    # the scorable positions follows p (binomial; 4 standard deviations).
    scorable = prompt_len - context - 1
    fraction = draw.masked.sum(dim=1) / scorable
    deviation = (fraction - p).abs() / torch.sqrt(p * (1 - p) / scorable + 1e-12)
    assert (deviation < 4.5).float().mean() > 0.97


def test_draws_depend_on_the_seed_only():
    a = draw_samples("llada", 11, 20, 4, 32, 8)
    b = draw_samples("llada", 11, 20, 4, 32, 8)
    c = draw_samples("llada", 12, 20, 4, 32, 8)
    assert torch.equal(a.masked, b.masked) and torch.equal(a.weight, b.weight)
    assert not torch.equal(a.masked, c.masked)
    # More samples keep the first ones: sample s is keyed by its index.
    more = draw_samples("dream", 5, 20, 4, 64, 32)
    assert torch.equal(more.masked[:32], draw_samples("dream", 5, 20, 4, 32, 32).masked)


def test_estimate_is_the_mean_and_its_standard_error():
    mean, error = estimate([1.0, 2.0, 3.0, 6.0])
    assert mean == 3.0
    assert math.isclose(error, math.sqrt(((4 + 1 + 0 + 9) / 3) / 4))
    assert estimate([-2.5]) == (-2.5, None)
