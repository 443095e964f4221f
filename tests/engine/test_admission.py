"""Bad requests are refused at admission with a message naming the problem, and
nothing else in the engine is disturbed."""

from __future__ import annotations

import pytest
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError

from tests.conftest import close_engine, make_engine

REFUSED = (ValueError, VLLMValidationError)
PROMPT = {"prompt_token_ids": [10, 20, 30, 40, 50]}


@pytest.fixture(scope="module")
def llm(tiny_dirs):
    engine = make_engine(tiny_dirs("llada"), max_model_len=128)
    yield engine
    close_engine(engine)


def generate(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize(
    "max_tokens, extra, message",
    [
        (24, {"block_length": 16}, "multiple of block_length"),
        (32, {"block_length": 16, "steps": 15}, "divisible by the number of blocks"),
        (16, {"remasking": "greedy"}, "unknown remasking 'greedy'"),
        (16, {"steps": 0}, "'steps' must be a positive integer"),
        (16, {"block_length": -8}, "'block_length' must be a positive integer"),
        (16, {"cfg_scale": -1.0}, "'cfg_scale' must be >= 0"),
        (16, {"steps": "16"}, "'steps' must be int"),
        (16, {"logits_eos_inf": "yes"}, "'logits_eos_inf' must be bool"),
        (16, {"steps": 16.0}, "'steps' must be int"),
        (16, {"stepz": 16}, "unknown diffusion option 'stepz'"),
        (16, {"temperature": 0.5}, "standard sampling parameter"),
        (16, {"alg": "entropy"}, "unknown diffusion option 'alg' for llada"),
    ],
)
def test_bad_options_are_refused_with_a_clear_message(llm, max_tokens, extra, message):
    with pytest.raises(REFUSED, match=message):
        generate(llm, [PROMPT], SamplingParams(max_tokens=max_tokens, extra_args=extra))


def test_unsupported_sampling_features_are_refused(llm):
    with pytest.raises(REFUSED, match="'logit_bias' is not supported"):
        generate(llm, [PROMPT], SamplingParams(max_tokens=16, logit_bias={5: 1.0}))
    with pytest.raises(REFUSED, match="logprobs"):  # the whole vocabulary per token
        generate(llm, [PROMPT], SamplingParams(max_tokens=16, logprobs=-1))
    with pytest.raises(REFUSED, match="'min_tokens' is not supported"):
        generate(llm, [PROMPT], SamplingParams(max_tokens=16, min_tokens=4))


def test_sequence_longer_than_max_model_len_fails_alone(llm):
    long_prompt = {"prompt_token_ids": list(range(3, 3 + 100))}
    # ignore_eos: the random checkpoint may emit EOS early, depending on the CPU's numerics.
    good = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outs = generate(llm, [long_prompt, PROMPT], [SamplingParams(max_tokens=64, temperature=0.0), good])
    assert outs[0].outputs[0].finish_reason == "error"
    assert outs[0].outputs[0].stop_reason and "max_model_len 128" in outs[0].outputs[0].stop_reason
    assert len(outs[1].outputs[0].token_ids) == 16


def test_guidance_twin_must_fit_max_model_len(llm):
    prompt = {"prompt_token_ids": list(range(3, 3 + 40))}
    cfg = SamplingParams(max_tokens=32, temperature=0.0, extra_args={"cfg_scale": 1.0, "steps": 32})
    out = generate(llm, [prompt], cfg)[0].outputs[0]
    assert out.finish_reason == "error" and "must fit twice into max_model_len 128" in out.stop_reason


def test_a_refused_batch_leaves_the_engine_serving(llm):
    good = SamplingParams(max_tokens=16, temperature=0.0, extra_args={"block_length": 8, "steps": 16})
    reference = generate(llm, [PROMPT], good)[0].outputs[0].token_ids
    bad = SamplingParams(max_tokens=16, extra_args={"block_length": 5})
    with pytest.raises(REFUSED):
        generate(llm, [PROMPT, PROMPT, PROMPT], [good, bad, good])
    again = generate(llm, [PROMPT, PROMPT], [good, good])
    assert [o.outputs[0].token_ids for o in again] == [reference, reference]
    assert llm.llm_engine.get_num_unfinished_requests() == 0
