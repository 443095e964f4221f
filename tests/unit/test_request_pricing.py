"""scheduler/admission.py on its own: each limit a request can exceed is named in its
refusal, and a request within every limit gets the track the scheduler prices it by."""

from __future__ import annotations

from types import SimpleNamespace

from tests.options_fixtures import llada
from vllm_dllm.scheduler.admission import Limits, price_request
from vllm_dllm.scheduler.track import RequestTrack

LIMITS = Limits(max_model_len=128, max_num_scheduled_tokens=128, block_size=16, pool_blocks=64, prefill_chunk=0)


def params(max_tokens=32, extra=None, prompt_logprobs=None):
    return SimpleNamespace(max_tokens=max_tokens, temperature=0.0, top_p=1.0, top_k=0, extra_args=extra,
                           prompt_logprobs=prompt_logprobs)


def test_a_request_within_every_limit_gets_its_track():
    track = price_request(params(32), 20, llada(), LIMITS)
    assert isinstance(track, RequestTrack)
    assert (track.prompt_len, track.canvas, track.blocks, track.scoring) == (20, 32, 4, 0)  # 52 slots: 4 blocks


def test_each_limit_is_named_in_the_refusal():
    defaults = llada()
    assert "exceeds max_model_len 128" in price_request(params(120), 20, defaults, LIMITS)
    assert "must fit twice into max_model_len" in price_request(params(48, {"cfg_scale": 1.0}), 20, defaults, LIMITS)
    small_budget = Limits(**{**LIMITS.__dict__, "max_num_scheduled_tokens": 40})
    assert "more than max_num_batched_tokens 40" in price_request(params(32), 20, defaults, small_budget)
    small_pool = Limits(**{**LIMITS.__dict__, "pool_blocks": 3})
    assert price_request(params(32), 20, defaults, small_pool) == "request needs 4 KV blocks, the whole pool has 3"
    assert "unknown diffusion option 'stepz'" in price_request(params(32, {"stepz": 1}), 20, defaults, LIMITS)
    assert price_request(None, 20, defaults, LIMITS) == "diffusion models only serve generation requests"


def test_prompt_scoring_is_priced_into_the_first_step_or_refused():
    scored = price_request(params(16, prompt_logprobs=1), 8, llada(), LIMITS)
    assert scored.scoring > 0
    refused = price_request(params(16, prompt_logprobs=1), 60, llada(), LIMITS)
    assert "prompt_logprobs of a 60-token prompt" in refused and "raise --max-num-batched-tokens" in refused
