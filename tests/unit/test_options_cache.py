"""The KV-cache options (vllm_dllm/options/common.py): cache knobs without a cache, the
sparse cache's parameters, delay_step.  Pure: no engine, no model.
"""

from __future__ import annotations

import pytest

from tests.options_fixtures import dream, llada, res
from vllm_dllm.options import OptionError


# ---------------------------------------------------------------------------
# KV-cache knobs without a cache
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["refresh_interval", "delay_step"])
def test_cache_knobs_without_a_cache_are_refused(key):
    with pytest.raises(OptionError) as info:
        res(llada(), {key: 2}, max_tokens=16)
    assert str(info.value) == (
        f"diffusion option '{key}'=2 only applies with a KV cache, but 'cache' is 'none'; "
        f"set 'cache' to prefix, dual, sparse or vicinity, or drop '{key}'"
    )
    assert getattr(res(llada(), {key: 2, "cache": "dual"}, max_tokens=16), key) == 2
    assert getattr(res(llada(), {key: 0}, max_tokens=16), key) == 0


def test_cache_knobs_of_the_server_do_not_blame_a_request_without_cache():
    defaults = llada(server={"cache": "dual", "refresh_interval": 4})
    opts = res(defaults, {"cache": "none"}, max_tokens=16)
    assert opts.cache == "none"
    with pytest.raises(OptionError, match=r"^--additional-config dllm: diffusion option 'refresh_interval'=4 only applies"):
        llada(server={"refresh_interval": 4})


def test_vicinity_is_set_with_its_cache_and_never_negative():
    assert res(llada(), {"cache": "vicinity"}, max_tokens=16).vicinity == 16  # the default span
    assert res(dream(), {"cache": "vicinity", "vicinity": 0}, max_tokens=16).vicinity == 0  # dual's queries
    assert res(llada(server={"cache": "vicinity", "vicinity": 4}), {}, max_tokens=16).vicinity == 4
    with pytest.raises(OptionError) as info:
        res(llada(), {"cache": "dual", "vicinity": 8}, max_tokens=16)
    assert str(info.value) == "diffusion option 'vicinity'=8 only applies with cache 'vicinity', but 'cache' is 'dual'"
    with pytest.raises(OptionError, match=r"^diffusion option 'vicinity' must be >= 0, got -1$"):
        res(llada(), {"cache": "vicinity", "vicinity": -1}, max_tokens=16)
    with pytest.raises(OptionError, match=r"'vicinity' must be int, got float 2.5"):
        res(llada(), {"cache": "vicinity", "vicinity": 2.5}, max_tokens=16)


# ---------------------------------------------------------------------------
# top_k / top_p: refused for LLaDA, every route reaches Dream's rule
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [("top_k", 50), ("top_p", 0.9)])
def test_llada_refuses_top_k_top_p(field, value):
    with pytest.raises(OptionError) as info:
        res(llada(), temperature=0.7, **{field: value})
    assert str(info.value) == (
        f"'{field}'={value} is not supported for LLaDA: its reference decoding has no "
        f"top-k/top-p filter (leave '{field}' unset)"
    )
    with pytest.raises(OptionError, match=f"'{field}'={value} is not supported for LLaDA"):
        res(llada(), {field: value})
    # vLLM's neutral values are not a request for a filter.
    assert res(llada(), temperature=0.7, top_k=-1, top_p=1.0).temperature == 0.7


def test_dream_top_k_top_p_from_extra_args_survive_temperature_0():
    # vLLM hands temperature-0 requests over with top_k 0 / top_p 1 whatever was asked.
    opts = res(dream(), {"top_k": 50, "top_p": 0.9, "alg": "maskgit_plus"}, temperature=0.0)
    assert (opts.top_k, opts.top_p) == (50, 0.9)


def test_dream_filter_precedence():
    gen = dream({"top_k": 50, "top_p": 0.95})  # generation_config / --override-generation-config
    assert (res(gen).top_k, res(gen).top_p) == (50, 0.95)  # temperature 0: vLLM's fields are neutral
    opts = res(gen, temperature=0.5, top_k=20, top_p=0.8)  # the request's fields (T > 0)
    assert (opts.top_k, opts.top_p) == (20, 0.8)
    opts = res(gen, {"top_k": 0, "top_p": 1}, temperature=0.5, top_k=20)  # extra_args win, 0/1: off
    assert (opts.top_k, opts.top_p) == (None, None)


@pytest.mark.parametrize("extra, message", [
    ({"top_k": -2}, "diffusion option 'top_k' must be a positive integer (0 or -1: no top-k filter), got -2"),
    ({"top_p": 0}, "diffusion option 'top_p' must lie in (0, 1] (1: no top-p filter), got 0"),
    ({"top_p": 1.5}, "diffusion option 'top_p' must lie in (0, 1] (1: no top-p filter), got 1.5"),
    ({"top_k": 5.0}, "diffusion option 'top_k' must be int, got float 5.0"),
])
def test_dream_filter_extra_args_checked(extra, message):
    with pytest.raises(OptionError) as info:
        res(dream(), extra)
    assert str(info.value) == message


def test_dream_server_filter_defaults_go_through_vllm():
    with pytest.raises(OptionError, match=r"--override-generation-config"):
        dream(server={"top_k": 50})


# ---------------------------------------------------------------------------
# Messages: one sentence naming the option, the value and what is allowed
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("defaults, extra, message", [
    (llada(), {"alg": "entropy"},
     "unknown diffusion option 'alg' for llada models ('alg' is a Dream option); LLaDA options are "
     "block_length, cache, cfg_scale, confidence_eos_eot_inf, credit_alpha, credit_boost, credit_decay, decoding, "
     "delay_step, factor, gamma, iter_smooth, "
     "logits_eos_inf, low_threshold, max_tokens_per_step, pool_kernel, refresh_interval, remasking, retention, scoring, selection, "
     "smooth_threshold_decay, smooth_weight, steps, threshold, vicinity"),
    (dream(), {"cfg_scale": 1.0},
     "unknown diffusion option 'cfg_scale' for dream models ('cfg_scale' is a LLaDA option); "
     "Dream options are alg, alg_temp, block_length, cache, credit_alpha, credit_boost, credit_decay, decoding, "
     "delay_step, eps, factor, gamma, low_threshold, max_tokens_per_step, pool_kernel, refresh_interval, retention, scoring, selection, steps, "
     "threshold, top_k, top_p, vicinity"),
    (llada(), {"stepz": 8}, "unknown diffusion option 'stepz' for llada models; LLaDA options are "
     "block_length, cache, cfg_scale, confidence_eos_eot_inf, credit_alpha, credit_boost, credit_decay, decoding, "
     "delay_step, factor, gamma, iter_smooth, "
     "logits_eos_inf, low_threshold, max_tokens_per_step, pool_kernel, refresh_interval, remasking, retention, scoring, selection, "
     "smooth_threshold_decay, smooth_weight, steps, threshold, vicinity"),
    (llada(), {"remasking": "bogus"},
     "unknown remasking 'bogus': diffusion option 'remasking' must be low_confidence or random"),
    (llada(), {"cache": "lru"},
     "unknown cache policy 'lru': diffusion option 'cache' must be none, prefix, dual, sparse or vicinity"),
    (dream(), {"alg": "greedy"},
     "unknown alg 'greedy': diffusion option 'alg' must be origin, maskgit_plus, topk_margin or entropy"),
    (llada(), {"steps": 0}, "diffusion option 'steps' must be a positive integer, got 0"),
    (llada(), {"steps": "8"}, "diffusion option 'steps' must be int, got str '8'"),
    (llada(), {"cfg_scale": -1}, "diffusion option 'cfg_scale' must be >= 0, got -1"),
    (llada(), {"iter_smooth": True, "smooth_weight": 0}, "diffusion option 'smooth_weight' must lie in (0, 1], got 0"),
    (llada(), {"smooth_weight": 0.5},
     "diffusion option 'smooth_weight'=0.5 only applies with 'iter_smooth': true"),
    (llada(), {"iter_smooth": True, "smooth_threshold_decay": 0.1},
     "diffusion option 'smooth_threshold_decay' only applies with decoding 'threshold', 'hierarchy' or 'credit', "
     "but 'decoding' is 'fixed'"),
    (llada(), {"iter_smooth": True, "decoding": "threshold", "smooth_threshold_decay": -0.1},
     "diffusion option 'smooth_threshold_decay' must lie in [0, 1], got -0.1"),
    (llada(), {"iter_smooth": "yes"}, "diffusion option 'iter_smooth' must be bool, got str 'yes'"),
    (dream(), {"iter_smooth": True},
     "unknown diffusion option 'iter_smooth' for dream models ('iter_smooth' is a LLaDA option); "
     "Dream options are alg, alg_temp, block_length, cache, credit_alpha, credit_boost, credit_decay, decoding, "
     "delay_step, eps, factor, gamma, low_threshold, max_tokens_per_step, pool_kernel, refresh_interval, retention, "
     "scoring, selection, steps, threshold, top_k, top_p, vicinity"),
    (dream(), {"eps": 1.5}, "diffusion option 'eps' must lie in (0, 1), got 1.5"),
    (llada(), {"temperature": 0.5},
     "'temperature' is a standard sampling parameter: set it as 'temperature' on the request, "
     "not in the diffusion options"),
])
def test_request_messages_are_one_clear_sentence(defaults, extra, message):
    with pytest.raises(OptionError) as info:
        res(defaults, extra, max_tokens=16)
    assert str(info.value) == message
    assert "diffusion option has" not in message and "diffusion option unknown" not in message


@pytest.mark.parametrize("server, message", [
    ({"stepz": 8}, "--additional-config dllm: unknown diffusion option 'stepz' for llada models; LLaDA options are "
     "block_length, cache, cfg_scale, confidence_eos_eot_inf, credit_alpha, credit_boost, credit_decay, decoding, "
     "delay_step, factor, gamma, iter_smooth, "
     "logits_eos_inf, low_threshold, max_tokens_per_step, pool_kernel, refresh_interval, remasking, retention, scoring, selection, "
     "smooth_threshold_decay, smooth_weight, steps, threshold, vicinity"),
    ({"remasking": "zzz"},
     "--additional-config dllm: unknown remasking 'zzz': diffusion option 'remasking' must be low_confidence or random"),
    ({"steps": 0}, "--additional-config dllm: diffusion option 'steps' must be a positive integer, got 0"),
    ({"max_num_logits": 1}, "--additional-config dllm: 'max_num_logits' must be an integer of at least 2, got 1"),
    ({"admission": "eager"},
     "--additional-config dllm: 'admission' must be one of greedy, lookahead, reserve, static, got 'eager'"),
])
def test_server_messages_name_their_source(server, message):
    with pytest.raises(OptionError) as info:
        llada(server=server)
    assert str(info.value) == message
