"""LLaDA's and Dream's own options (vllm_dllm/options/llada.py, dream.py): blocks, steps,
remasking, CFG, Dream's algorithms and filters.  Pure: no engine, no model.
"""

from __future__ import annotations

import pytest

from tests.options_fixtures import dream, llada, res
from vllm_dllm.options import DREAM, LLADA, OptionError
from vllm_dllm.serving.server_defaults import ServerDefaults


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


def test_dream_default_steps_above_the_bound_are_capped():
    # Dream's release generation_config.json sets steps 512: a short request that sets
    # no steps runs the most the bound allows instead of being refused.
    assert res(dream({"steps": 512}), max_tokens=8).steps == 64
    assert res(dream(server={"steps": 512}), {"block_length": 4}, max_tokens=8).steps == 64
    assert res(dream({"steps": 512}), max_tokens=256).steps == 512
    with pytest.raises(OptionError, match="steps=512 is more than 8 per generated token"):
        res(dream({"steps": 512}), {"steps": 512}, max_tokens=8)


def test_default_steps_are_fitted_to_the_blocks_a_request_asks_for():
    # 96 tokens in LLaDA's blocks of 32 are 3 blocks: a server default of 64 steps
    # becomes 66, where the same 64 set by the request is refused.
    opts = res(llada(server={"steps": 64}), max_tokens=96)
    assert (opts.num_blocks, opts.steps, opts.steps_per_block) == (3, 66, 22)
    with pytest.raises(OptionError, match="steps=64 must be divisible by the number of blocks"):
        res(llada(), {"steps": 64}, max_tokens=96)
    # Fewer default steps than blocks: one a block.
    assert res(llada(server={"steps": 2}), {"block_length": 8}, max_tokens=32).steps == 4
    assert res(dream({"steps": 10}), {"block_length": 4}, max_tokens=12).steps == 12
    # Rounded up, so a request's own delayed update still has a step of its block to wait.
    sparse = {"block_length": 8, "cache": "sparse", "delay_step": 1}
    assert res(llada(server={"steps": 7}), sparse, max_tokens=32).steps == 8
    # Within the bounds: LLaDA's canvas, Dream's 8 a token.
    assert res(llada(server={"steps": 31}), {"block_length": 8}, max_tokens=32).steps == 32
    assert res(dream({"steps": 511}), {"block_length": 16}, max_tokens=64).steps == 512


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
