"""The shipped task model, decoded through the plugin, does what it was trained to do.

A slice of each task's held-out split runs through vLLM's engine with exact decoding
(steps = canvas length, one block, low-confidence remasking).  Chance is about zero
for a whole answer (a random 16-48 symbol string, a 1-7 digit sum, one of the 40-120
values in the context) and 1/26 per letter or 1/10 per digit in place, so the floors
below only pass when the engine, the checkpoint loader and the decoding rule are all
right.  They sit well under the
model's measured accuracy on 500 instances (README, lab/training-log.md) so that a
correct engine does not fail on an unlucky slice of 20.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import oracle, oracle_model, oracle_rules
from tests.tie_free import compare_until
from lab import eval as task_eval
from vllm_dllm.default_model import PATH
from lab.tasks import TASKS, TEST
from lab.training.curriculum import fitting_task

N = 20
# Minimum whole answers right out of N, and minimum fraction of characters in place.
# Measured on 500 held-out instances (README): retrieval 98.2%, addition 99.6%,
# copy 97.6%, reverse 94.8%.
EXACT_FLOORS = {"retrieval": 15, "addition": 15, "copy": 15, "reverse": 15}
CHAR_FLOORS = {"retrieval": 0.9, "addition": 0.9, "copy": 0.9, "reverse": 0.9}


@pytest.fixture(scope="module")
def runner():
    runner = task_eval.OfflineRunner(
        str(PATH),
        dict(max_model_len=512, max_num_seqs=32, kv_cache_memory_bytes=256 << 20,
             gpu_memory_utilization=0.3, dtype="float32", enforce_eager=True, seed=0),
    )
    yield runner
    runner.engine.engine_core.shutdown()


def test_shipped_checkpoint_is_a_llada_checkpoint_with_a_task_sized_canvas():
    config = json.loads((Path(PATH) / "config.json").read_text())
    assert config["architectures"] == ["LLaDAModelLM"]
    generation = json.loads((Path(PATH) / "generation_config.json").read_text())
    assert generation["max_new_tokens"] == max(t.gen_length for t in TASKS.values())
    assert (Path(PATH) / "model.safetensors").stat().st_size < 16 << 20


@pytest.mark.parametrize("name", sorted(EXACT_FLOORS))
def test_exact_decoding_answers_held_out_instances_well_above_chance(runner, name):
    result = task_eval.evaluate_task(runner, TASKS[name], N, seed=123, xargs={})
    assert result.n == N
    assert result.correct >= EXACT_FLOORS[name], f"{name}: {result.correct}/{N} correct"
    assert result.char_accuracy >= CHAR_FLOORS[name], f"{name}: {result.char_accuracy:.0%} characters in place"
    # Exact decoding commits one canvas position per step; a request ends as soon as
    # everything up to its end-of-turn is committed, so at most one step per position.
    assert result.steps_per_token >= 1.0
    assert result.denoising_steps <= N * TASKS[name].gen_length


# Tie-free prompts compared per cache policy.  The trained model's confidences often
# saturate at 1.0 in float32, so many prompts tie (copy almost always); prompts are
# drawn until this many compare, on any CPU.
TIE_FREE_PROMPTS = 6


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_plugin_matches_the_oracle_on_the_trained_model(runner, cache):
    # Token for token against the independent reference, on real task prompts and the
    # real trained weights (float32 on both sides), exact and with the dual cache.
    from vllm import SamplingParams

    config = json.loads((Path(PATH) / "config.json").read_text())
    eot, eos = json.loads((Path(PATH) / "generation_config.json").read_text())["eos_token_id"]
    model = oracle_model.load_oracle(str(PATH))

    def compare_draw(draw: int) -> int:
        rng = random.Random(7 + 1000 * draw)
        compared = 0
        for name, block in (("retrieval", 4), ("addition", 4), ("copy", 8)):
            task = TASKS[name]
            prompts = [runner.prompt_ids(task.sample(rng, TEST).prompt) for _ in range(3)]
            xargs = {"steps": task.gen_length, "block_length": block, "cache": cache}
            outs = runner.generate(prompts, SamplingParams(max_tokens=task.gen_length, temperature=0.0, extra_args=xargs))
            for prompt, out in zip(prompts, outs):
                want = oracle.llada_generate(
                    model, prompt, gen_length=task.gen_length, steps=task.gen_length, block_length=block,
                    mask_id=config["mask_token_id"], eos_id=eos, eot_id=eot, cache=cache,
                )
                if want.ties:
                    continue
                assert list(out.token_ids) == oracle_rules.trim_at_eos(want.tokens, {eot, eos}), f"{name} ({cache})"
                compared += 1
        return compared

    assert compare_until(TIE_FREE_PROMPTS, compare_draw) >= TIE_FREE_PROMPTS


# Canvas lengths other than each task's own (8 for retrieval and addition, 56 for copy
# and reverse): a request asks for whatever max_tokens it likes, and one without gets
# the model's max_new_tokens (56).  The model must fill the rest of a longer canvas
# with end-of-text (else `add 9+3=` on 56 positions can read `NE`).  Copy and reverse
# run on the instances that fit: exactly 16 symbols at 16, 16-32 at 32.
OTHER_LENGTHS = [(name, length) for name in ("retrieval", "addition") for length in (16, 32, 56)] + [
    (name, length) for name in ("copy", "reverse") for length in (16, 32)
]


@pytest.mark.parametrize("name, length", OTHER_LENGTHS)
def test_answers_stay_right_on_other_canvas_lengths(runner, name, length):
    task = fitting_task(TASKS[name], length)
    result = task_eval.evaluate_task(runner, task, N, seed=321, xargs={}, max_tokens=length)
    assert result.max_tokens == length and result.n == N
    assert result.correct >= EXACT_FLOORS[name], f"{name} at {length}: {result.correct}/{N} correct"


def test_default_canvas_is_the_generation_config_one():
    # What a chat request without max_tokens gets, and the longest length tested above.
    generation = json.loads((Path(PATH) / "generation_config.json").read_text())
    assert generation["max_new_tokens"] == 56 == max(length for _, length in OTHER_LENGTHS)


def test_autotokenizer_loads_the_shipped_model_without_remote_code(runner):
    # transformers 5.x's AutoTokenizer loads the config first; an auto_map in it made
    # AutoConfig ask interactively whether to run configuration_llada.py.  In a clean
    # process (no plugin registration) with no stdin, nothing may ask, and the
    # tokenizer must encode a chat prompt exactly as the served engine does.
    config = json.loads((Path(PATH) / "config.json").read_text())
    assert "auto_map" not in config
    code = (
        "import json, sys\n"
        "from transformers import AutoTokenizer\n"
        f"tok = AutoTokenizer.from_pretrained({str(PATH)!r})\n"
        "chat = tok.apply_chat_template([{'role': 'user', 'content': 'add 9+3='}], tokenize=False,"
        " add_generation_prompt=True)\n"
        "print(json.dumps(tok.encode(chat, add_special_tokens=False)))\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "custom code" not in proc.stdout + proc.stderr and "trust_remote_code" not in proc.stdout + proc.stderr
    ids = json.loads(proc.stdout.strip().splitlines()[-1])
    assert ids == runner.prompt_ids("add 9+3=")


def test_eval_writes_results_only_when_asked():
    assert task_eval.build_parser().parse_args([]).out is None
    args = task_eval.build_parser().parse_args(["--max-tokens", "8,56", "--out", "r.json"])
    assert task_eval.parse_lengths(args.max_tokens) == [8, 56] and str(args.out) == "r.json"


def test_constrained_answers_parse_and_stay_right(runner):
    """Structured outputs on the trained model: a regex in the answer's own
    format keeps the answers right, and a JSON schema wrapping the answer (a format
    the model never saw; its keys are forced) always parses."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from lab.tasks import score

    task = TASKS["addition"]
    items = task_eval.instances(task, N, 321)
    prompts = [runner.prompt_ids(item.prompt) for item in items]
    regex = SamplingParams(max_tokens=task.gen_length, temperature=0.0,
                           structured_outputs=StructuredOutputsParams(regex="[0-9]{1,8}"))
    texts = [out.text for out in runner.generate(prompts, regex)]
    assert all(re.fullmatch("[0-9]{1,8}", text) for text in texts), texts
    assert sum(score(item, text) for item, text in zip(items, texts)) >= EXACT_FLOORS["addition"]
    schema = {"type": "object", "properties": {"answer": {"type": "string", "pattern": "^[0-9]{1,8}$"}},
              "required": ["answer"], "additionalProperties": False}
    wrapped = SamplingParams(max_tokens=32, temperature=0.0, structured_outputs=StructuredOutputsParams(json=schema))
    for out in runner.generate(prompts, wrapped):
        assert re.fullmatch("[0-9]{1,8}", json.loads(out.text)["answer"]), out.text


def test_json_replies_on_the_default_canvas_complete_and_end_early(runner):
    """What a client sending `response_format` gets with the server's defaults (the
    default canvas, compact JSON): a document that parses and ends where the model
    ends its answer, not digits or key characters until the canvas runs out."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    items = task_eval.instances(TASKS["addition"], N, 322)
    prompts = [runner.prompt_ids(item.prompt) for item in items]
    canvas = 56  # the shipped generation_config's max_new_tokens
    sum_schema = {"type": "object", "properties": {"sum": {"type": "integer"}}, "required": ["sum"]}
    for structured in (StructuredOutputsParams(json=sum_schema), StructuredOutputsParams(json_object=True)):
        params = SamplingParams(max_tokens=canvas, temperature=0.0, structured_outputs=structured)
        for out in runner.generate(prompts, params):
            assert isinstance(json.loads(out.text), dict), out.text
            assert out.finish_reason == "stop" and len(out.token_ids) < canvas // 2, (out.text, out.finish_reason)
            if structured.json is not None:
                assert re.fullmatch(r'\{"sum":-?[0-9]+\}', out.text), out.text
