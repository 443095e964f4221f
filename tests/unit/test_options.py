"""Option resolution every family shares (vllm_dllm/options/common.py, registry.py) and
the server-wide settings (server_defaults.py): precedence, unknown keys and types,
request-wide fields, serialisation.  Pure: no engine, no model.
"""

from __future__ import annotations

import pytest

from tests.options_fixtures import dream, llada, res
from vllm_dllm.options import (
    DREAM,
    LLADA,
    PAPER_DEFAULTS,
    DreamOptions,
    LLaDAOptions,
    OptionError,
    sequence_copies,
)
from vllm_dllm.serving.server_defaults import DEFAULT_MAX_NUM_LOGITS, DEFAULT_MAX_STEPS_PER_CALL, ServerDefaults


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


def test_max_steps_per_call_default_set_and_carried():
    assert llada().max_steps_per_call == DEFAULT_MAX_STEPS_PER_CALL
    one = llada(server={"max_steps_per_call": 1})
    assert one.max_steps_per_call == 1
    assert ServerDefaults.from_dict(one.to_dict()).max_steps_per_call == 1


@pytest.mark.parametrize("bad", [0, -2, True, "4", 4.0, None])
def test_max_steps_per_call_validated(bad):
    with pytest.raises(OptionError, match="max_steps_per_call"):
        ServerDefaults.build(LLADA, {}, {"max_steps_per_call": bad})


def test_max_steps_per_call_not_a_request_option():
    with pytest.raises(OptionError, match="max_steps_per_call"):
        res(llada(), {"max_steps_per_call": 2})


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
