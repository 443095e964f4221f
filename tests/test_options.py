"""Unit tests for vllm_dllm/options/ and server_defaults.py: precedence, validation, serialisation.

Pure: no engine, no model.
"""

from __future__ import annotations

import pytest

from vllm_dllm.options import (
    DREAM,
    LLADA,
    PAPER_DEFAULTS,
    DreamOptions,
    LLaDAOptions,
    OptionError,
    resolve,
    sequence_copies,
)
from vllm_dllm.server_defaults import DEFAULT_MAX_NUM_LOGITS, ServerDefaults


def llada(gen_config=None, server=None) -> ServerDefaults:
    return ServerDefaults.build(LLADA, gen_config or {}, server or {})


def dream(gen_config=None, server=None) -> ServerDefaults:
    return ServerDefaults.build(DREAM, gen_config or {}, server or {})


def res(defaults, extra=None, *, max_tokens=64, temperature=0.0, top_p=1.0, top_k=0):
    return resolve(
        defaults,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        extra_args=extra,
    )


# ---------------------------------------------------------------------------
# Precedence: paper defaults < generation_config < server dict < request extra_args
# ---------------------------------------------------------------------------


def test_paper_defaults_llada():
    opts = res(llada(), max_tokens=128)
    assert isinstance(opts, LLaDAOptions)
    assert opts.block_length == 32
    assert opts.steps == 128  # steps default to the generation length
    assert opts.remasking == "low_confidence"
    assert opts.cfg_scale == 0.0
    assert opts.logits_eos_inf is False
    assert opts.confidence_eos_eot_inf is False
    assert opts.num_blocks == 4
    assert opts.steps_per_block == 32
    assert not opts.uses_cfg
    assert sequence_copies(opts) == 1


def test_paper_defaults_dream():
    opts = res(dream(), max_tokens=48)
    assert isinstance(opts, DreamOptions)
    assert opts.eps == 1e-3
    assert opts.alg == "origin"
    assert opts.alg_temp is None
    assert opts.steps == 48
    assert opts.top_p is None and opts.top_k is None
    assert not opts.uses_cfg
    assert sequence_copies(opts) == 1


@pytest.mark.parametrize(
    "gen_config, server, extra, expected",
    [
        ({}, {}, None, 32),  # paper
        ({"block_length": 16}, {}, None, 16),  # generation_config beats paper
        ({"block_length": 16}, {"block_length": 8}, None, 8),  # server beats gen config
        ({"block_length": 16}, {"block_length": 8}, {"block_length": 4}, 4),  # request wins
        ({}, {"block_length": 8}, {"block_length": 64}, 64),
        ({"block_length": 16}, {}, {"block_length": 2}, 2),
    ],
)
def test_precedence_block_length(gen_config, server, extra, expected):
    opts = res(llada(gen_config, server), extra, max_tokens=64)
    assert opts.block_length == expected


def test_precedence_every_layer_independently():
    defaults = llada(
        {"steps": 32, "remasking": "random", "cfg_scale": 0.5},
        {"steps": 16, "logits_eos_inf": True},
    )
    opts = res(defaults, {"steps": 8}, max_tokens=64)
    assert opts.steps == 8  # request
    assert opts.logits_eos_inf is True  # server
    assert opts.remasking == "random"  # generation_config
    assert opts.cfg_scale == 0.5  # generation_config
    assert opts.confidence_eos_eot_inf is False  # paper
    assert opts.uses_cfg and sequence_copies(opts) == 2

    opts = res(defaults, None, max_tokens=64)
    assert opts.steps == 16  # server beats generation_config


def test_precedence_dream():
    defaults = dream(
        {"alg": "entropy", "eps": 0.01, "steps": 10, "alg_temp": 0.5},
        {"alg": "maskgit_plus"},
    )
    opts = res(defaults, None, max_tokens=20)
    assert (opts.alg, opts.eps, opts.steps, opts.alg_temp) == ("maskgit_plus", 0.01, 10, 0.5)
    opts = res(defaults, {"alg": "topk_margin", "eps": 0.1, "alg_temp": None}, max_tokens=20)
    assert (opts.alg, opts.eps, opts.alg_temp) == ("topk_margin", 0.1, None)


def test_generation_config_ignores_foreign_and_malformed_keys():
    # Sampling fields and unknown keys in generation_config.json are not diffusion
    # options; a value of the wrong type is skipped, not fatal (server still starts).
    defaults = llada(
        {
            "temperature": 0.7,
            "top_p": 0.5,
            "max_new_tokens": 7,
            "bos_token_id": 1,
            "steps": "128",
            "block_length": 16.0,
            "logits_eos_inf": 2,
            "remasking": None,
        }
    )
    assert defaults.overrides == PAPER_DEFAULTS[LLADA]


def test_build_does_not_mutate_inputs_and_paper_defaults():
    gen = {"block_length": 16}
    server = {"block_length": 8, "max_num_logits": 64}
    before = dict(PAPER_DEFAULTS[LLADA])
    defaults = llada(gen, server)
    assert gen == {"block_length": 16}
    assert server == {"block_length": 8, "max_num_logits": 64}
    assert PAPER_DEFAULTS[LLADA] == before
    assert "max_num_logits" not in defaults.overrides
    assert defaults.max_num_logits == 64


def test_attention_backend_is_checked_and_survives_the_round_trip():
    defaults = llada({}, {"attention_backend": "torch"})
    assert defaults.attention_backend == "torch"
    assert "attention_backend" not in defaults.overrides
    assert ServerDefaults.from_dict(defaults.to_dict()) == defaults
    assert llada({}, {}).attention_backend is None  # chosen by device at start
    assert llada({}, {"attention_backend": "flash"}).attention_backend == "flash"
    with pytest.raises(OptionError, match="'attention_backend' must be one of torch, triton, flash, got 'bogus'"):
        llada({}, {"attention_backend": "bogus"})


# ---------------------------------------------------------------------------
# Unknown keys and wrong types
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [LLADA, DREAM])
def test_unknown_request_key_names_the_key(kind):
    defaults = ServerDefaults.build(kind, {}, {})
    with pytest.raises(OptionError, match="bogus_knob"):
        res(defaults, {"bogus_knob": 1})


def test_kind_specific_keys_are_unknown_for_the_other_kind():
    with pytest.raises(OptionError, match="remasking"):
        res(dream(), {"remasking": "random"})
    with pytest.raises(OptionError, match="'alg'"):
        res(llada(), {"alg": "entropy"})
    with pytest.raises(OptionError, match="eps"):
        res(llada(), {"eps": 0.1})


@pytest.mark.parametrize("kind", [LLADA, DREAM])
def test_unknown_server_key_names_the_key(kind):
    with pytest.raises(OptionError, match="mystery"):
        ServerDefaults.build(kind, {}, {"mystery": True})


@pytest.mark.parametrize(
    "kind, key, value",
    [
        (LLADA, "steps", True),  # bool is not an int here
        (LLADA, "steps", "64"),
        (LLADA, "steps", 64.0),
        (LLADA, "steps", None),
        (LLADA, "block_length", False),
        (LLADA, "block_length", "32"),
        (LLADA, "block_length", 32.0),
        (LLADA, "remasking", 1),
        (LLADA, "cfg_scale", True),
        (LLADA, "cfg_scale", "0.5"),
        (LLADA, "logits_eos_inf", 2),
        (LLADA, "logits_eos_inf", "true"),
        (LLADA, "confidence_eos_eot_inf", -1),
        (DREAM, "steps", True),
        (DREAM, "steps", "16"),
        (DREAM, "steps", 16.0),
        (DREAM, "eps", True),
        (DREAM, "eps", "0.001"),
        (DREAM, "alg", None),
        (DREAM, "alg_temp", True),
        (DREAM, "alg_temp", "0.5"),
    ],
)
def test_wrong_type_names_the_key(kind, key, value):
    defaults = ServerDefaults.build(kind, {}, {})
    with pytest.raises(OptionError, match=f"'{key}'"):
        res(defaults, {key: value})
    # The same check guards the server dict.
    with pytest.raises(OptionError, match=f"'{key}'"):
        ServerDefaults.build(kind, {}, {key: value})


def test_int_accepted_where_float_expected():
    assert res(llada(), {"cfg_scale": 1}).cfg_scale == 1.0
    assert isinstance(res(llada(), {"cfg_scale": 1}).cfg_scale, float)
    assert res(dream(), {"eps": 0.5}).eps == 0.5
    assert res(dream(), {"alg_temp": 2}).alg_temp == 2.0


@pytest.mark.parametrize("field", ["temperature", "seed", "max_tokens"])
@pytest.mark.parametrize("kind", [LLADA, DREAM])
def test_standard_sampling_fields_refused_in_extra_args(kind, field):
    defaults = ServerDefaults.build(kind, {}, {})
    with pytest.raises(OptionError, match=f"'{field}'.*standard sampling parameter"):
        res(defaults, {field: 1})
    with pytest.raises(OptionError, match=f"'{field}'"):
        ServerDefaults.build(kind, {}, {field: 1})


@pytest.mark.parametrize("bad", [[1, 2], "steps=4", 3])
def test_extra_args_must_be_a_dict(bad):
    with pytest.raises(OptionError):
        res(llada(), bad)


def test_server_config_must_be_a_dict():
    with pytest.raises(OptionError):
        ServerDefaults.build(LLADA, {}, ["steps", 4])


def test_empty_extra_args_is_fine():
    assert res(llada(), {}) == res(llada(), None)


# ---------------------------------------------------------------------------
# LLaDA: block length, steps
# ---------------------------------------------------------------------------


def test_llada_unset_block_length_not_dividing_falls_back_to_one_block():
    opts = res(llada(), max_tokens=40)  # paper block 32 does not divide 40
    assert opts.block_length == 40 and opts.num_blocks == 1
    assert opts.steps == 40 and opts.steps_per_block == 40
    opts = res(llada(), max_tokens=7)
    assert opts.block_length == 7


def test_llada_unset_block_length_dividing_is_kept():
    opts = res(llada(), max_tokens=96)
    assert opts.block_length == 32 and opts.num_blocks == 3


def test_llada_generation_config_block_length_fallback():
    opts = res(llada({"block_length": 16}), max_tokens=24)
    assert opts.block_length == 24


def test_llada_explicit_block_length_not_dividing_raises():
    with pytest.raises(OptionError, match="block_length=32") as info:
        res(llada(), {"block_length": 32}, max_tokens=40)
    assert "max_tokens=40" in str(info.value)
    with pytest.raises(OptionError, match="block_length"):
        res(llada(), {"block_length": 3}, max_tokens=64)


@pytest.mark.parametrize("bad", [0, -4])
def test_llada_explicit_nonpositive_block_length_raises(bad):
    with pytest.raises(OptionError, match="block_length"):
        res(llada(), {"block_length": bad}, max_tokens=64)


def test_llada_block_longer_than_generation_raises():
    with pytest.raises(OptionError, match="block_length"):
        res(llada(), {"block_length": 128}, max_tokens=64)


def test_llada_steps_default_is_gen_length():
    assert res(llada(), max_tokens=64).steps == 64
    assert res(llada(), {"block_length": 8}, max_tokens=64).steps == 64


def test_llada_steps_divisibility():
    # 64 tokens in blocks of 16 -> 4 blocks; steps must be a multiple of 4.
    opts = res(llada(), {"block_length": 16, "steps": 12}, max_tokens=64)
    assert opts.num_blocks == 4 and opts.steps_per_block == 3
    with pytest.raises(OptionError, match="steps=10") as info:
        res(llada(), {"block_length": 16, "steps": 10}, max_tokens=64)
    assert "4" in str(info.value)
    with pytest.raises(OptionError, match="steps"):
        res(llada(), {"block_length": 16, "steps": 2}, max_tokens=64)


def test_llada_steps_more_than_gen_length_is_refused():
    # LLaDA commits >= 1 token per step: steps beyond the canvas would commit nothing.
    with pytest.raises(OptionError) as info:
        res(llada(), {"steps": 256, "block_length": 32}, max_tokens=64)
    assert str(info.value).startswith("steps=256 is more than the generation length (max_tokens=64")
    assert "use at most 64 steps" in str(info.value)
    assert res(llada(), {"steps": 64, "block_length": 32}, max_tokens=64).steps == 64


def test_llada_default_steps_more_than_gen_length_are_capped():
    # A server default meant for long generations must not refuse short ones; for
    # LLaDA the capped run commits exactly the same tokens.
    opts = res(llada(server={"steps": 128}), max_tokens=16)
    assert opts.steps == 16
    assert res(llada(server={"steps": 128}), max_tokens=256).steps == 128


def test_dream_steps_more_than_gen_length_are_allowed():
    # Dream's schedule unmasks int(masks * (1 - s/t)) per step, which can be 0: more
    # steps than positions is a valid reference setting (bounded at 8 per token).
    assert res(dream(), {"steps": 64}, max_tokens=16).steps == 64
    with pytest.raises(OptionError, match="steps=129 is more than 8 per generated token"):
        res(dream(), {"steps": 129}, max_tokens=16)


@pytest.mark.parametrize("kind", [LLADA, DREAM])
@pytest.mark.parametrize("bad", [0, -1])
def test_nonpositive_steps_refused(kind, bad):
    defaults = ServerDefaults.build(kind, {}, {})
    with pytest.raises(OptionError, match="steps"):
        res(defaults, {"steps": bad})


def test_llada_unknown_remasking():
    with pytest.raises(OptionError, match="remasking 'greedy'"):
        res(llada(), {"remasking": "greedy"})
    assert res(llada(), {"remasking": "random"}).remasking == "random"


def test_llada_negative_cfg_refused():
    with pytest.raises(OptionError, match="cfg_scale"):
        res(llada(), {"cfg_scale": -0.5})


# ---------------------------------------------------------------------------
# Dream
# ---------------------------------------------------------------------------


def test_dream_unknown_alg():
    with pytest.raises(OptionError, match="alg 'greedy'"):
        res(dream(), {"alg": "greedy"})
    for alg in ("origin", "maskgit_plus", "topk_margin", "entropy"):
        assert res(dream(), {"alg": alg}).alg == alg


@pytest.mark.parametrize("eps", [0, 0.0, 1, 1.0, -0.1, 1.5])
def test_dream_eps_out_of_bounds(eps):
    with pytest.raises(OptionError, match="eps"):
        res(dream(), {"eps": eps})


@pytest.mark.parametrize("eps", [1e-6, 0.5, 0.999])
def test_dream_eps_in_bounds(eps):
    assert res(dream(), {"eps": eps}).eps == eps


@pytest.mark.parametrize("alg_temp, expected", [(0, None), (0.0, None), (None, None), (0.3, 0.3)])
def test_dream_alg_temp_zero_is_none(alg_temp, expected):
    assert res(dream(), {"alg_temp": alg_temp}).alg_temp == expected


def test_dream_negative_alg_temp_refused():
    with pytest.raises(OptionError, match="alg_temp"):
        res(dream(), {"alg_temp": -1.0})


@pytest.mark.parametrize(
    "top_p, top_k, exp_p, exp_k",
    [
        (1.0, 0, None, None),
        (1.0, -1, None, None),
        (0.9, 0, 0.9, None),
        (1.0, 20, None, 20),
        (0.5, 1, 0.5, 1),
    ],
)
def test_dream_top_p_top_k_off_values(top_p, top_k, exp_p, exp_k):
    opts = res(dream(), top_p=top_p, top_k=top_k)
    assert opts.top_p == exp_p
    assert opts.top_k == exp_k


@pytest.mark.parametrize("top_p", [0.0, -0.1, 1.01])
def test_dream_top_p_out_of_range(top_p):
    with pytest.raises(OptionError, match="top_p"):
        res(dream(), top_p=top_p)


def test_dream_steps_default_is_gen_length():
    assert res(dream(), max_tokens=33).steps == 33
    assert res(dream(), {"steps": 5}, max_tokens=33).steps == 5


# ---------------------------------------------------------------------------
# Request-wide fields
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [LLADA, DREAM])
@pytest.mark.parametrize("max_tokens", [None, 0, -3])
def test_max_tokens_refused(kind, max_tokens):
    defaults = ServerDefaults.build(kind, {}, {})
    with pytest.raises(OptionError, match="max_tokens"):
        res(defaults, max_tokens=max_tokens)


@pytest.mark.parametrize("kind", [LLADA, DREAM])
def test_negative_temperature_refused(kind):
    defaults = ServerDefaults.build(kind, {}, {})
    with pytest.raises(OptionError, match="temperature"):
        res(defaults, temperature=-0.1)


@pytest.mark.parametrize("kind", [LLADA, DREAM])
def test_temperature_passes_through_as_float(kind):
    defaults = ServerDefaults.build(kind, {}, {})
    opts = res(defaults, temperature=1)
    assert opts.temperature == 1.0 and isinstance(opts.temperature, float)


def test_options_are_frozen_and_hashable():
    opts = res(llada())
    with pytest.raises(Exception):
        opts.steps = 3  # type: ignore[misc]
    assert hash(opts) == hash(res(llada()))


# ---------------------------------------------------------------------------
# max_num_logits (server-only key)
# ---------------------------------------------------------------------------


def test_max_num_logits_default_and_set():
    assert llada().max_num_logits == DEFAULT_MAX_NUM_LOGITS
    assert llada(server={"max_num_logits": 7}).max_num_logits == 7


@pytest.mark.parametrize("bad", [0, -1, True, "64", 64.0, None])
def test_max_num_logits_validated(bad):
    with pytest.raises(OptionError, match="max_num_logits"):
        ServerDefaults.build(LLADA, {}, {"max_num_logits": bad})


def test_max_num_logits_not_a_request_option():
    with pytest.raises(OptionError, match="max_num_logits"):
        res(llada(), {"max_num_logits": 16})


def test_max_num_logits_ignored_in_generation_config():
    assert llada({"max_num_logits": 3}).max_num_logits == DEFAULT_MAX_NUM_LOGITS


# ---------------------------------------------------------------------------
# Serialisation
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "defaults",
    [
        ServerDefaults.build(LLADA, {}, {}),
        ServerDefaults.build(
            LLADA, {"block_length": 16}, {"steps": 8, "max_num_logits": 5, "cfg_scale": 1}
        ),
        ServerDefaults.build(DREAM, {"alg": "entropy"}, {"alg_temp": None, "eps": 0.01}),
    ],
)
def test_to_dict_from_dict_round_trip(defaults):
    import json

    data = defaults.to_dict()
    again = ServerDefaults.from_dict(json.loads(json.dumps(data)))
    assert again == defaults
    assert again.to_dict() == data
    # The copy is independent of the original.
    data["overrides"]["steps"] = 999
    assert defaults.overrides.get("steps") != 999
    # And it resolves a request identically.
    assert res(again, max_tokens=32) == res(defaults, max_tokens=32)


# Out-of-range server settings fail at start-up; out-of-range values in a
# checkpoint's generation_config.json are ignored.


@pytest.mark.parametrize(
    "server, message",
    [
        ({"block_length": 0}, "'block_length' must be a positive integer"),
        ({"block_length": -5}, "'block_length' must be a positive integer"),
        ({"steps": 0}, "'steps' must be a positive integer"),
        ({"remasking": "zzz"}, "unknown remasking 'zzz'"),
    ],
)
def test_out_of_range_server_settings_fail_at_startup(server, message):
    with pytest.raises(OptionError, match=message):
        llada(server=server)


def test_out_of_range_generation_config_values_are_ignored():
    defaults = llada(gen_config={"block_length": 0, "steps": -3})
    assert "block_length" not in defaults.overrides or defaults.overrides["block_length"] > 0
    assert res(defaults, max_tokens=64).block_length > 0


def test_booleans_arrive_as_0_or_1_through_the_openai_protocol():
    # vLLM types vllm_xargs values as str | int | float: JSON true arrives as 1.
    opts = res(llada(), {"logits_eos_inf": 1, "confidence_eos_eot_inf": 0}, max_tokens=16)
    assert opts.logits_eos_inf is True and opts.confidence_eos_eot_inf is False


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"steps": 17}, "more than the generation length"),
        ({"cfg_scale": float("inf")}, "must be a finite number"),
        ({"cfg_scale": float("nan")}, "must be a finite number"),
    ],
)
def test_unbounded_values_are_refused(extra, message):
    with pytest.raises(OptionError, match=message):
        res(llada(), extra, max_tokens=16)


def test_tiny_alg_temp_is_refused():
    with pytest.raises(OptionError, match="'alg_temp' must be 0 or at least"):
        res(dream(), {"alg_temp": 1e-39}, max_tokens=16)
    assert res(dream(), {"alg_temp": 0.0}, max_tokens=16).alg_temp is None


# ---------------------------------------------------------------------------
# KV-cache knobs without a cache (issue 15)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["refresh_interval", "delay_step"])
def test_cache_knobs_without_a_cache_are_refused(key):
    with pytest.raises(OptionError) as info:
        res(llada(), {key: 2}, max_tokens=16)
    assert str(info.value) == (
        f"diffusion option '{key}'=2 only applies with a KV cache, but 'cache' is 'none'; "
        f"set 'cache' to prefix, dual or sparse, or drop '{key}'"
    )
    assert getattr(res(llada(), {key: 2, "cache": "dual"}, max_tokens=16), key) == 2
    assert getattr(res(llada(), {key: 0}, max_tokens=16), key) == 0


def test_cache_knobs_of_the_server_do_not_blame_a_request_without_cache():
    defaults = llada(server={"cache": "dual", "refresh_interval": 4})
    opts = res(defaults, {"cache": "none"}, max_tokens=16)
    assert opts.cache == "none"
    with pytest.raises(OptionError, match=r"^--additional-config dllm: diffusion option 'refresh_interval'=4 only applies"):
        llada(server={"refresh_interval": 4})


# ---------------------------------------------------------------------------
# top_k / top_p: refused for LLaDA, every route reaches Dream's rule (issue 14, 15)
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
# Messages: one sentence naming the option, the value and what is allowed (issue 15)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("defaults, extra, message", [
    (llada(), {"alg": "entropy"},
     "unknown diffusion option 'alg' for llada models ('alg' is a Dream option); LLaDA options are "
     "block_length, cache, cfg_scale, confidence_eos_eot_inf, credit_alpha, credit_boost, credit_decay, decoding, "
     "delay_step, factor, gamma, "
     "logits_eos_inf, low_threshold, max_tokens_per_step, pool_kernel, refresh_interval, remasking, retention, scoring, selection, steps, threshold"),
    (dream(), {"cfg_scale": 1.0},
     "unknown diffusion option 'cfg_scale' for dream models ('cfg_scale' is a LLaDA option); "
     "Dream options are alg, alg_temp, block_length, cache, credit_alpha, credit_boost, credit_decay, decoding, "
     "delay_step, eps, factor, gamma, low_threshold, max_tokens_per_step, pool_kernel, refresh_interval, retention, scoring, selection, steps, "
     "threshold, top_k, top_p"),
    (llada(), {"stepz": 8}, "unknown diffusion option 'stepz' for llada models; LLaDA options are "
     "block_length, cache, cfg_scale, confidence_eos_eot_inf, credit_alpha, credit_boost, credit_decay, decoding, "
     "delay_step, factor, gamma, "
     "logits_eos_inf, low_threshold, max_tokens_per_step, pool_kernel, refresh_interval, remasking, retention, scoring, selection, steps, threshold"),
    (llada(), {"remasking": "bogus"},
     "unknown remasking 'bogus': diffusion option 'remasking' must be low_confidence or random"),
    (llada(), {"cache": "lru"},
     "unknown cache policy 'lru': diffusion option 'cache' must be none, prefix, dual or sparse"),
    (dream(), {"alg": "greedy"},
     "unknown alg 'greedy': diffusion option 'alg' must be origin, maskgit_plus, topk_margin or entropy"),
    (llada(), {"steps": 0}, "diffusion option 'steps' must be a positive integer, got 0"),
    (llada(), {"steps": "8"}, "diffusion option 'steps' must be int, got str '8'"),
    (llada(), {"cfg_scale": -1}, "diffusion option 'cfg_scale' must be >= 0, got -1"),
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
     "delay_step, factor, gamma, "
     "logits_eos_inf, low_threshold, max_tokens_per_step, pool_kernel, refresh_interval, remasking, retention, scoring, selection, steps, threshold"),
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
