"""LLaDA2.x options: the official generate()'s names and defaults, the 2.1 modes, the
block-aligned canvas, parallel decoding's keys, refusals, and the LLaDA2.2 start-up
check."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.options_fixtures import llada as llada_server
from lab.eval import canvas_for, served_decoding
from vllm_dllm.options import LLADA2, OptionError, resolve
from vllm_dllm.options.llada2 import unsupported_release
from vllm_dllm.phases import block_causal_phase
from vllm_dllm.serving.server_defaults import ServerDefaults
from lab.tasks import ALL_TASKS


def options(extra=None, server=None, generation=None, max_tokens=40, temperature=0.0, top_k=0, top_p=1.0):
    defaults = ServerDefaults.build(LLADA2, generation or {}, server or {})
    return resolve(defaults, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                   extra_args=extra)


def test_defaults_are_the_official_functions():
    o = options()
    assert (o.block_length, o.steps, o.threshold, o.minimal_topk, o.eos_early_stop) == (32, 32, 0.95, 1, False)
    assert o.editing_threshold is None and o.max_post_steps == 16 and o.num_to_transfer == 1
    assert o.top_k is None and o.top_p is None and not o.uses_cfg and o.block_causal


def test_the_eval_asks_a_block_diffusion_model_for_at_least_one_block():
    # LLaDA2.0 clamps steps per block to max_tokens // minimal_topk: a request for 8
    # tokens would commit a 32-position block at 4 a step, off the official defaults.

    retrieval, copy = ALL_TASKS["retrieval"], ALL_TASKS["copy"]
    assert retrieval.gen_length < 32 < copy.gen_length
    assert options(max_tokens=8).steps_per_block == 8 and options(max_tokens=32).steps_per_block == 32
    assert canvas_for(retrieval, options(max_tokens=retrieval.gen_length)) == 32
    assert canvas_for(retrieval, options({"block_length": 8}, max_tokens=retrieval.gen_length)) == 8
    assert canvas_for(retrieval, options(generation={"block_length": 16}, max_tokens=8)) == 16
    assert canvas_for(copy, options(max_tokens=copy.gen_length)) == copy.gen_length
    # LLaDA decodes its canvas exactly as long as asked.
    llada = resolve(llada_server(), max_tokens=8, temperature=0.0, top_p=1.0, top_k=0, extra_args=None)
    assert canvas_for(retrieval, llada) == retrieval.gen_length


def test_a_server_describes_its_decoding_on_its_metrics_page():
    import types

    import prometheus_client

    from vllm_dllm.serving.metrics import DECODING_INFO, decoding_info
    from vllm_dllm.serving.server_config import RESOLVED_KEY

    def info(defaults):
        return decoding_info(types.SimpleNamespace(additional_config={RESOLVED_KEY: defaults.to_dict()}))

    llada2 = info(ServerDefaults.build(LLADA2, {"block_length": 16}, {}))
    assert llada2 == {"kind": "llada2", "block_causal": "true", "block_length": "16"}
    llada = info(llada_server())
    assert llada["kind"] == "llada" and llada["block_causal"] == "false"
    # What a client reads back: the series of the model it asks, none for another.
    registry = prometheus_client.CollectorRegistry()
    gauge = prometheus_client.Gauge(DECODING_INFO, "doc", ["model_name", "engine", *llada2], registry=registry)
    gauge.labels(model_name="m", engine="0", **llada2).set(1)
    page = prometheus_client.generate_latest(registry).decode()
    assert served_decoding(page, "m") == {"model_name": "m", "engine": "0", **llada2}
    assert served_decoding(page, "other") == {}


def test_generation_config_then_server_then_request():
    o = options(generation={"threshold": 0.8, "block_length": 16}, server={"threshold": 0.6})
    assert (o.threshold, o.block_length) == (0.6, 16)
    assert options({"threshold": 0.5}, server={"threshold": 0.6}).threshold == 0.5


def test_modes_switch_editing_on_and_request_keys_win():
    quality = options({"mode": "quality"})
    assert (quality.threshold, quality.editing_threshold, quality.max_post_steps) == (0.7, 0.5, 16)
    speed = options({"mode": "speed", "max_post_steps": 4})
    assert (speed.threshold, speed.editing_threshold, speed.max_post_steps) == (0.5, 0.0, 4)
    assert options(server={"mode": "speed"}).editing_threshold == 0.0
    assert options({"editing_threshold": 0.9}).editing_threshold == 0.9
    # A mode stands for its values at its own level: that level's keys win over it,
    # the next level over both.
    server = {"mode": "quality", "threshold": 0.8}
    assert (options(server=server).threshold, options(server=server).editing_threshold) == (0.8, 0.5)
    assert options({"mode": "speed"}, server=server).threshold == 0.5
    assert options({"threshold": 0.6}, server=server).threshold == 0.6


def test_the_canvas_is_block_aligned_and_outputs_max_tokens():
    o = options({"block_length": 8}, max_tokens=20).placed(13)
    # The prompt's last 5 tokens share the first block with 3 generated positions.
    assert (o.lead, o.num_blocks, o.gen_length, o.output_length) == (5, 4, 27, 20)
    assert options({"block_length": 8}, max_tokens=16).placed(16).gen_length == 16
    # 2.0's steps are capped by max_tokens / minimal_topk, as the reference does.
    assert options({"steps": 32, "minimal_topk": 2}, max_tokens=20).steps_per_block == 10
    # The scheduler's bound on a block's steps: 2.0 ends a block within block_length
    # steps; editing adds the post steps.
    assert options({"block_length": 8, "steps": 32}).max_steps_per_block == 8
    assert options({"block_length": 8, "mode": "quality"}).max_steps_per_block == 8 + 16 + 1


def test_block_causal_phases():
    # First step: every block from the start (prompt blocks 0, 1 and the active 2).
    assert block_causal_phase(8, 20, 0, 0, False).query_start == 0
    assert block_causal_phase(8, 20, 0, 0, False).query_end == 24
    # Inside a block: the active block only; a block's first step: the finished one too.
    assert (block_causal_phase(8, 20, 0, 3, True).query_start, block_causal_phase(8, 20, 0, 3, True).query_end) == (16, 24)
    assert (block_causal_phase(8, 20, 1, 0, True).query_start, block_causal_phase(8, 20, 1, 0, True).query_end) == (16, 32)


@pytest.mark.parametrize("extra, message", [
    ({"cache": "dual"}, "unknown diffusion option 'cache' for llada2 models"),
    ({"mode": "turbo"}, "unknown mode 'turbo': diffusion option 'mode' must be quality or speed"),
    ({"editing_threshold": 1.5}, "diffusion option 'editing_threshold' must lie in [0, 1], got 1.5"),
    ({"num_to_transfer": 0}, "diffusion option 'num_to_transfer' must be a positive integer, got 0"),
    ({"max_post_steps": -1}, "diffusion option 'max_post_steps' must lie in [0, 256], got -1"),
    ({"max_post_steps": 10**9}, "diffusion option 'max_post_steps' must lie in [0, 256], got 1000000000"),
    ({"threshold": float("nan")}, "diffusion option 'threshold' must be a finite number, got nan"),
    ({"block_length": 0}, "diffusion option 'block_length' must be a positive integer, got 0"),
    ({"minimal_topk": 50}, "minimal_topk=50 is more than the generation length (max_tokens=40)"),
    ({"eos_early_stop": "yes"}, "diffusion option 'eos_early_stop' must be bool, got str 'yes'"),
])
def test_refusals_name_the_problem(extra, message):
    with pytest.raises(OptionError) as error:
        options(extra)
    assert message in str(error.value)


@pytest.mark.parametrize("threshold", [0, 0.0, -0.5, 1.0, 1.5])
def test_every_threshold_the_official_generate_takes_is_accepted(threshold):
    """The official generate() commits the masks whose confidence exceeds `threshold`,
    whatever its value: 0 (or less) commits a block's masks at once, above 1 the quota
    alone decides."""
    assert options({"threshold": threshold}).threshold == threshold
    assert options(server={"threshold": threshold}).threshold == threshold


def test_llada_keeps_its_own_threshold_range():
    from vllm_dllm.options import LLADA

    defaults = ServerDefaults.build(LLADA, {}, {})
    with pytest.raises(OptionError, match=r"'threshold' must lie in \(0, 1\], got 0"):
        resolve(defaults, max_tokens=16, temperature=0.0, top_p=1.0, top_k=0,
                extra_args={"decoding": "threshold", "threshold": 0})


def test_parallel_decoding_takes_llada_keys_and_the_official_threshold():
    assert options().decoding == "fixed"  # the official choice of masks
    o = options({"decoding": "threshold", "max_tokens_per_step": 4})
    # One `threshold` key: the official default (0.95) unless a level sets it.
    assert (o.decoding, o.threshold, o.max_tokens_per_step) == ("threshold", 0.95, 4)
    assert options({"decoding": "threshold", "threshold": 0.6}).threshold == 0.6
    quality = options({"mode": "quality", "decoding": "hierarchy", "low_threshold": 0.2})
    assert (quality.threshold, quality.low_threshold, quality.editing_threshold) == (0.7, 0.2, 0.5)
    credit = options({"decoding": "credit", "credit_alpha": 1, "credit_decay": 0.5, "credit_boost": 0.1})
    assert (credit.credit_alpha, credit.credit_decay, credit.credit_boost) == (1.0, 0.5, 0.1)
    assert options({"decoding": "entropy_bound", "gamma": 2}).gamma == 2.0
    # A server default rule and its parameter; a request may choose another rule, and a
    # mode's threshold is not blamed on a rule that does not read one.
    server = {"decoding": "factor", "factor": 0.5}
    assert (options(server=server).decoding, options(server=server).factor) == ("factor", 0.5)
    assert options({"decoding": "entropy_bound", "gamma": 0.5}, server=server).decoding == "entropy_bound"
    assert options({"mode": "speed", "decoding": "factor"}).editing_threshold == 0.0


@pytest.mark.parametrize("extra, message", [
    ({"decoding": "greedy"},
     "unknown decoding rule 'greedy': diffusion option 'decoding' must be fixed, threshold, factor, entropy_bound, "
     "hierarchy or credit"),
    ({"decoding": "factor", "threshold": 0.8},
     "diffusion option 'threshold' only applies with decoding 'fixed', 'threshold', 'hierarchy' or 'credit', "
     "but 'decoding' is 'factor'"),
    ({"gamma": 0.5}, "diffusion option 'gamma' only applies with decoding 'entropy_bound', but 'decoding' is 'fixed'"),
    ({"mode": "quality", "low_threshold": 0.2},
     "diffusion option 'low_threshold' only applies with decoding 'hierarchy', but 'decoding' is 'fixed'"),
    ({"max_tokens_per_step": 2},
     "diffusion option 'max_tokens_per_step' only applies with a parallel decoding rule "
     "(threshold, factor, entropy_bound, hierarchy or credit), but 'decoding' is 'fixed'"),
    ({"decoding": "hierarchy", "low_threshold": 0.96},
     "diffusion option 'low_threshold'=0.96 must not exceed 'threshold'=0.95 (decoding 'hierarchy')"),
    ({"decoding": "credit", "credit_decay": 1.5}, "diffusion option 'credit_decay' must lie in [0, 1], got 1.5"),
    ({"decoding": "factor", "factor": 0}, "diffusion option 'factor' must be > 0, got 0"),
    ({"decoding": "threshold", "max_tokens_per_step": 1.5},
     "diffusion option 'max_tokens_per_step' must be int, got float 1.5"),
])
def test_parallel_decoding_refusals_are_one_sentence(extra, message):
    with pytest.raises(OptionError) as error:
        options(extra)
    assert str(error.value) == message


def test_sampling_fields_are_vllms():
    o = options(temperature=0.7, top_k=20, top_p=0.9)
    assert (o.temperature, o.top_k, o.top_p) == (0.7, 20, 0.9)
    with pytest.raises(OptionError, match="'top_k' is a standard sampling parameter"):
        options({"top_k": 5})


def test_llada22_checkpoints_are_recognised():
    assert unsupported_release(SimpleNamespace()) is None
    problem = unsupported_release(SimpleNamespace(delete_token_id=156930, split_token_id=156931))
    assert "LLaDA2.2" in problem and "delete_token_id, split_token_id" in problem


def test_iter_smooth_takes_llada_keys_and_falls_the_official_threshold():
    o = options({"iter_smooth": True, "smooth_weight": 0.4, "smooth_threshold_decay": 0.05})
    assert (o.iter_smooth, o.smooth_weight, o.smooth_threshold_decay) == (True, 0.4, 0.05)
    assert not options().iter_smooth
    # The official rule reads a threshold: the decay applies under `fixed` too.
    assert options({"iter_smooth": True, "decoding": "fixed", "smooth_threshold_decay": 0}).smooth_threshold_decay == 0
    with pytest.raises(OptionError, match="'smooth_threshold_decay' only applies with decoding 'fixed', 'threshold'"):
        options({"iter_smooth": True, "decoding": "factor", "smooth_threshold_decay": 0.1})
    with pytest.raises(OptionError, match="'smooth_weight'=0.4 only applies with 'iter_smooth': true"):
        options({"smooth_weight": 0.4})
