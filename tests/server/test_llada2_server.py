"""LLaDA2.x through `vllm serve` (the OpenAI server, our HTTP front end, one server
for the module): completions and streams equal the reference, chat uses the Ling
frame, inapplicable options are one-sentence 400s, editing shows in /metrics."""

from __future__ import annotations

import json
import random
import re

import httpx
import pytest

from tests.conftest import random_prompt
from tests.oracle_llada2 import llada2_generate, load_llada2_oracle
from tests.server_utils import ServerProcess
from tests.llada_server import chat_prompt_ids, complete, metrics, sse_events
from tests.tie_free import compare_each_case


@pytest.fixture(scope="module")
def model_dir(tiny_dirs):
    return tiny_dirs("llada2")


@pytest.fixture(scope="module")
def server(model_dir):
    srv = ServerProcess(model_dir, env={"VLLM_PLUGINS": "dllm"})
    srv.start()
    try:
        yield srv
    finally:
        if srv.exit_seconds is None:
            srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.base_url, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def ids(model_dir):
    with open(f"{model_dir}/generation_config.json") as f:
        return json.load(f)


CASES = [
    (9, 16, {"block_length": 8, "steps": 4, "threshold": 0.5}),
    (5, 20, {"block_length": 8, "mode": "quality"}),
]


def test_completions_and_streams_equal_the_reference(server, client, model_dir, ids):
    oracle = load_llada2_oracle(model_dir)
    edits_before = metrics(client).get("vllm:diffusion_num_edited_tokens_total", 0.0)
    edits = 0

    def compare_draw(draw, pending):
        nonlocal edits
        rng = random.Random(40 + draw)
        tied = []
        for case in pending:
            prompt_len, max_tokens, xargs = case
            prompt = random_prompt(rng, prompt_len)
            body = dict(prompt=prompt, max_tokens=max_tokens, temperature=0.0, vllm_xargs=xargs)
            out = complete(client, server, **body, return_token_ids=True)["choices"][0]
            events = sse_events(client, server, "/v1/completions", body)
            streamed = "".join(choice.get("text") or "" for event in events for choice in event.get("choices", []))
            assert streamed == out["text"], f"{xargs}: the stream differs from the completion"
            options = dict(xargs)
            if options.pop("mode", None) == "quality":
                options = {"threshold": 0.7, "editing_threshold": 0.5, "max_post_steps": 16, **options}
            want = llada2_generate(oracle, prompt, gen_length=max_tokens, mask_id=ids["mask_token_id"],
                                   eos_id=ids["eos_token_id"], **options)
            if want.ties:
                tied.append(case)
                continue
            assert out["token_ids"] == want.tokens, f"{xargs}: server {out['token_ids']} != reference {want.tokens}"
            edits += 2 * want.edits  # the completion and the stream
        return tied

    compare_each_case(CASES, compare_draw)
    assert edits > 0
    assert metrics(client)["vllm:diffusion_num_edited_tokens_total"] - edits_before == edits


def test_chat_uses_the_ling_frame(server, client, model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": "hi there"}]
    resp = client.post("/v1/chat/completions", json={
        "model": server.model, "messages": messages, "max_tokens": 8, "vllm_xargs": {"block_length": 8},
        "return_token_ids": True,
    })
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["prompt_token_ids"] == chat_prompt_ids(tokenizer, messages)
    assert len(body["choices"][0]["token_ids"]) <= 8


def test_eval_decodes_with_the_servers_defaults(server):
    # The eval against a LLaDA2 server asks for at least one block and sets only what
    # --xargs sets: LLaDA's exact steps and block_length would change the attention
    # mask of a block-causal model (lab.eval's docstring).
    from lab.eval import ServerRunner
    from lab.tasks import ALL_TASKS, Instance

    runner = ServerRunner(server.base_url, None)
    assert not runner.exact and runner.block_length == 32
    assert runner.default_canvas(ALL_TASKS["multiply"], {}) == 32
    assert runner.default_canvas(ALL_TASKS["addition"], {"block_length": 8}) == 8
    assert runner.default_canvas(ALL_TASKS["multiply"], {"block_length": 8}) == 24
    assert runner.default_canvas(ALL_TASKS["sort"], {}) == 48
    body = runner.body(Instance("multiply", "mul 3*4=", "12"), 32, {"threshold": 0.5})
    assert body["vllm_xargs"] == {"threshold": 0.5} and body["max_tokens"] == 32


@pytest.mark.parametrize("xargs, message", [
    ({"cache": "dual"}, "unknown diffusion option 'cache' for llada2 models"),
    ({"mode": "fast"}, "unknown mode 'fast'"),
    ({"editing_threshold": 2}, "'editing_threshold' must lie in [0, 1]"),
    ({"decoding": "entropy_bound", "threshold": 0.5},
     "diffusion option 'threshold' only applies with decoding 'fixed', 'threshold', 'hierarchy' or 'credit', "
     "but 'decoding' is 'entropy_bound'"),
    ({"max_tokens_per_step": 2}, "'max_tokens_per_step' only applies with a parallel decoding rule"),
])
def test_inapplicable_options_are_400s(server, client, xargs, message):
    resp = client.post("/v1/completions", json={
        "model": server.model, "prompt": [5, 6, 7], "max_tokens": 8, "vllm_xargs": xargs,
    })
    assert resp.status_code == 400 and message in resp.text, resp.text


def test_echo_with_logprobs_scores_the_prompt_and_the_elbo_is_refused(server, client):
    # The block-causal chain rule, position by position: tests/engine/test_logprobs.py.
    resp = client.post("/v1/completions", json={
        "model": server.model, "prompt": [5, 6, 7, 8], "max_tokens": 8, "echo": True, "logprobs": 1,
    })
    assert resp.status_code == 200, resp.text
    token_logprobs = resp.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert token_logprobs[0] is None and all(lp <= 0 for lp in token_logprobs[1:4])
    resp = client.post("/v1/completions", json={
        "model": server.model, "prompt": [5, 6, 7, 8], "max_tokens": 8,
        "vllm_xargs": {"likelihood": "elbo", "context_tokens": 2},
    })
    assert resp.status_code == 400 and "block-diffusion (LLaDA2) models have none" in resp.text, resp.text


def test_structured_outputs_are_enforced(server, client):
    # The mechanism and every mode: tests/engine/test_structured_outputs.py.
    for body, valid in (({"structured_outputs": {"regex": "[a-c]{2}-[0-9]{2}"}}, lambda t: re.fullmatch("[a-c]{2}-[0-9]{2}", t)),
                        ({"structured_outputs": {"choice": ["up", "down"]}, "vllm_xargs": {"mode": "quality"}},
                         lambda t: t in ("up", "down"))):
        text = complete(client, server, prompt="pick", max_tokens=16, temperature=0.0, **body)["choices"][0]["text"]
        assert valid(text), text
