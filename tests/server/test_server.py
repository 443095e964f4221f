"""The plugin through vLLM's OpenAI-compatible server, over loopback HTTP: what an
API user relies on.  Usage counts, `max_tokens` as the canvas, `n`, `stop`, `echo`,
the chat template, exactness against the independent oracle, streaming, logprobs,
client disconnects and graceful shutdown (the last test: it stops this module's
server).  Option validation is test_server_validation.py, metrics and concurrent load
test_server_metrics.py; each runs its own server (tests/llada_server.py).
"""

from __future__ import annotations

import json
import random
import re
import threading

import httpx
import pytest

from tests import oracle, oracle_model, oracle_rules
from tests.llada_server import (  # noqa: F401 (pytest fixtures among them)
    assert_same_text,
    chat,
    chat_prompt_ids,
    client,
    complete,
    encode,
    metrics,
    model_dir,
    PROMPTS,
    post,
    REQUEST_TIMEOUT_S,
    server,
    special_ids,
    sse_events,
    streamed_text,
    tokenizer,
    wait_idle,
    XARGS,
)
from tests.tie_free import compare_each_case


# --------------------------------------------------------------------------------------
# 1. completions and chat basics
# --------------------------------------------------------------------------------------


def test_the_server_log_shows_the_plugins_lines(server):
    """The plugin's INFO lines reach vLLM's log with vLLM's format: a user reads there
    which attention backend the model got and which special ids it decodes with."""
    log = server.log_text()
    assert re.search(r"INFO .*\] Diffusion attention backend: \w+ on cpu", log), server.log_tail()
    assert re.search(r"INFO .*\] Diffusion model loaded; special ids", log), server.log_tail()


def test_completion_usage_and_generation_length(server, client, tokenizer):
    lengths_ended = []
    for prompt, max_tokens in zip(PROMPTS, (16, 8, 24, 16)):
        out = complete(
            client, server, prompt=prompt, max_tokens=max_tokens,
            vllm_xargs={"steps": max_tokens, "block_length": 8}, return_token_ids=True,
        )
        (choice,) = out["choices"]
        usage = out["usage"]
        ids = choice["token_ids"]
        assert usage["completion_tokens"] == len(ids)
        assert usage["prompt_tokens"] == len(encode(tokenizer, prompt))
        assert choice["prompt_token_ids"] == encode(tokenizer, prompt)
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert_same_text(choice["text"], tokenizer.decode(ids, skip_special_tokens=True))
        if choice["finish_reason"] == "length":
            # max_tokens is the canvas: without an EOS every position is generated.
            assert len(ids) == max_tokens
            lengths_ended.append(prompt)
        else:
            assert choice["finish_reason"] == "stop"
            assert len(ids) <= max_tokens
    assert lengths_ended, "no request ran to its full generation length"


def test_n_with_seed(server, client):
    body = dict(prompt="hello", max_tokens=16, n=2, seed=3, temperature=0.8, vllm_xargs=XARGS)
    first = complete(client, server, **body)
    again = complete(client, server, **body)
    assert sorted(c["index"] for c in first["choices"]) == [0, 1]
    texts = [c["text"] for c in sorted(first["choices"], key=lambda c: c["index"])]
    assert texts == [c["text"] for c in sorted(again["choices"], key=lambda c: c["index"])]
    assert texts[0] != texts[1], "the two samples of n=2 are identical"
    assert first["usage"]["prompt_tokens"] > 0


def test_stop_string_cuts_text(server, client):
    body = dict(prompt="The quick brown fox", max_tokens=16, vllm_xargs=XARGS)
    full = complete(client, server, **body)["choices"][0]["text"]
    # A stop string: the first printable ASCII character not seen before it (k >= 1).
    cut = next(
        (k for k in range(1, len(full)) if full[k].isascii() and full[k].isprintable() and full[k] not in full[:k]),
        None,
    )
    assert cut is not None, f"no usable stop string in {full!r}"
    stop = full[cut]
    out = complete(client, server, **body, stop=[stop])["choices"][0]
    assert out["text"] == full[:cut]
    assert out["finish_reason"] == "stop"
    assert out["stop_reason"] == stop


def test_echo_returns_prompt_and_text(server, client):
    body = dict(prompt="Once upon a time there was", max_tokens=16, vllm_xargs=XARGS)
    plain = complete(client, server, **body)["choices"][0]["text"]
    echoed = complete(client, server, **body, echo=True)["choices"][0]["text"]
    assert echoed == body["prompt"] + plain


def test_chat_uses_chat_template(server, client, tokenizer):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}]
    out = chat(client, server, messages=messages, max_tokens=16, vllm_xargs=XARGS, return_token_ids=True)
    (choice,) = out["choices"]
    want_prompt = chat_prompt_ids(tokenizer, messages)
    assert out["usage"]["prompt_tokens"] == len(want_prompt)
    assert out["prompt_token_ids"] == want_prompt
    assert choice["message"]["role"] == "assistant"
    ids = choice["token_ids"]
    assert out["usage"]["completion_tokens"] == len(ids)
    assert_same_text(choice["message"]["content"], tokenizer.decode(ids, skip_special_tokens=True))
    if choice["finish_reason"] == "length":
        assert len(ids) == 16
    # The same conversation as a token prompt on /v1/completions gives the same text.
    same = complete(client, server, prompt=want_prompt, max_tokens=16, vllm_xargs=XARGS)
    assert same["choices"][0]["text"] == choice["message"]["content"]


# --------------------------------------------------------------------------------------
# 2. exactness against the independent oracle
# --------------------------------------------------------------------------------------

EXACT_CASES = [
    (5, {"steps": 16, "block_length": 8}),
    (9, {"steps": 16, "block_length": 8}),
    (13, {"steps": 16, "block_length": 8}),
    (7, {"steps": 8, "block_length": 16}),
    (6, {"steps": 16, "block_length": 16, "cfg_scale": 1.5}),
    (4, {"steps": 16, "block_length": 8, "remasking": "low_confidence"}),
]


def test_exact_against_oracle(server, client, tokenizer, special_ids, model_dir):
    model = oracle_model.load_oracle(model_dir)

    def compare_draw(draw: int, pending: list[tuple]) -> list[tuple]:
        rng = random.Random(2024 + draw)
        tied = []
        for case in pending:
            prompt_len, extra = case
            # Token-id prompts of clean text: vLLM's detokenizer (tokenizers' DecodeStream
            # primed with the prompt) re-emits the prompt's text when a prompt ends inside
            # a UTF-8 sequence, which random byte ids often do; that is not the plugin's.
            text = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ,.") for _ in range(3 * prompt_len))
            prompt = encode(tokenizer, text)[:prompt_len]
            assert "\ufffd" not in tokenizer.decode(prompt)
            out = complete(
                client, server, prompt=prompt, max_tokens=16, temperature=0.0,
                vllm_xargs=extra, return_token_ids=True,
            )
            choice = out["choices"][0]
            result = oracle.llada_generate(
                model, prompt, gen_length=16, steps=extra["steps"], block_length=extra["block_length"],
                temperature=0.0, cfg_scale=extra.get("cfg_scale", 0.0), remasking="low_confidence",
                mask_id=special_ids["mask"], eos_id=special_ids["eos"], eot_id=special_ids["eot"],
            )
            if result.ties:
                tied.append(case)  # either side of an exact tie is right: draw this case again
                continue
            want = oracle_rules.trim_at_eos(result.tokens, special_ids["eos"])
            assert choice["token_ids"] == want, f"{extra}: server {choice['token_ids']} != oracle {want}"
            assert_same_text(choice["text"], tokenizer.decode(want, skip_special_tokens=True))
        return tied

    compare_each_case(EXACT_CASES, compare_draw)


# --------------------------------------------------------------------------------------
# 3. streaming
# --------------------------------------------------------------------------------------


def test_streaming_completions_matches_non_streaming(server, client):
    body = dict(prompt="hello", max_tokens=32, temperature=0.0, vllm_xargs={"steps": 32, "block_length": 8})
    full = complete(client, server, **body)
    events = sse_events(client, server, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    text, pieces, finish = streamed_text(events, chat_api=False)
    assert text == full["choices"][0]["text"]
    assert finish == full["choices"][0]["finish_reason"]
    assert len(pieces) > 1, "the whole text arrived in one chunk: nothing was streamed"
    usage = [e["usage"] for e in events if e.get("usage")]
    assert usage and usage[-1]["completion_tokens"] == full["usage"]["completion_tokens"]


def test_streaming_chat_matches_non_streaming(server, client):
    body = dict(
        messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=32, temperature=0.0,
        vllm_xargs={"steps": 32, "block_length": 8},
    )
    full = chat(client, server, **body)
    events = sse_events(client, server, "/v1/chat/completions", body)
    text, pieces, finish = streamed_text(events, chat_api=True)
    assert text == full["choices"][0]["message"]["content"]
    assert finish == full["choices"][0]["finish_reason"]
    assert len(pieces) > 1, "the whole text arrived in one chunk: nothing was streamed"
    roles = [c["delta"].get("role") for e in events for c in e.get("choices", []) if c.get("delta")]
    assert "assistant" in roles


def test_completion_logprobs_stream_as_they_are_returned(server, client):
    body = dict(prompt="hello", max_tokens=16, temperature=0.0, logprobs=2, vllm_xargs={"steps": 16, "block_length": 8})
    full = complete(client, server, **body)["choices"][0]
    logprobs = full["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) > 0
    assert all(lp <= 0 for lp in logprobs["token_logprobs"])
    assert all(1 <= len(top) <= 3 for top in logprobs["top_logprobs"])  # the token and the top 2
    events = sse_events(client, server, "/v1/completions", body)
    streamed = [lp for e in events for c in e.get("choices", []) if c.get("logprobs")
                for lp in c["logprobs"]["token_logprobs"]]
    assert streamed == logprobs["token_logprobs"]


def test_echo_with_logprobs_scores_the_prompt(server, client):
    """lm-eval's loglikelihood request: the prompt's tokens with their logprobs
    (the first one has none), then the one generated token's."""
    body = dict(prompt="the cat sat on the mat", max_tokens=1, temperature=0.0, echo=True, logprobs=1,
                vllm_xargs={"steps": 1, "block_length": 1})
    choice = complete(client, server, **body)["choices"][0]
    token_logprobs = choice["logprobs"]["token_logprobs"]
    assert token_logprobs[0] is None and len(token_logprobs) >= 3
    assert all(lp is not None and lp <= 0 for lp in token_logprobs[1:])
    assert choice["text"].startswith("the cat sat on the mat")


def test_elbo_of_a_continuation_comes_back_with_the_response(server, client, tokenizer):
    """The models' own estimator: the ELBO of the prompt's last tokens given its first
    N, with its standard error, in the response's kv_transfer_params; the same seed
    gives the same value, a longer continuation of the same context a lower one."""
    context = encode(tokenizer, "the cat sat on the")
    body = dict(max_tokens=1, temperature=0.0, seed=3,
                vllm_xargs={"steps": 1, "block_length": 1, "likelihood": "elbo", "context_tokens": len(context),
                            "mc_samples": 16, "mc_batch": 8})
    one = complete(client, server, prompt=context + encode(tokenizer, " mat"), **body)
    estimate = one["kv_transfer_params"]["likelihood"]
    assert estimate["estimator"] == "elbo" and estimate["context_tokens"] == len(context)
    assert estimate["mc_samples"] == 16 and estimate["mc_batch"] == 8
    assert estimate["loglikelihood"] < 0 and estimate["standard_error"] >= 0
    again = complete(client, server, prompt=context + encode(tokenizer, " mat"), **body)
    assert again["kv_transfer_params"]["likelihood"]["loglikelihood"] == pytest.approx(estimate["loglikelihood"],
                                                                                       rel=1e-5)
    # The response is otherwise an ordinary completion, and keeps the estimate when
    # a stop string (found by vLLM's front end, not the engine) ends it.
    assert one["choices"][0]["finish_reason"] in ("length", "stop")
    generating = {**body, "max_tokens": 16, "vllm_xargs": {**body["vllm_xargs"], "steps": 16, "block_length": 16}}
    text = complete(client, server, prompt=context + encode(tokenizer, " mat"), **generating)["choices"][0]["text"]
    stop = text.strip()[:2]
    assert stop, text
    stopped = complete(client, server, prompt=context + encode(tokenizer, " mat"), **generating, stop=[stop])
    assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["choices"][0]["stop_reason"] == stop
    assert stopped["kv_transfer_params"]["likelihood"]["loglikelihood"] == pytest.approx(
        estimate["loglikelihood"], rel=1e-5)
    # A continuation past the prompt's end is named.
    resp = post(client, server, "/v1/completions",
                {"prompt": context, **body, "vllm_xargs": {**body["vllm_xargs"], "context_tokens": len(context)}},
                expect=None)
    assert resp.status_code == 400 and "must be less than the prompt's" in resp.text, resp.text[:400]


def test_the_openai_sdk_reads_logprobs_sync_and_streaming(server):
    import openai

    sdk = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", timeout=REQUEST_TIMEOUT_S)
    messages = [{"role": "user", "content": "Tell me a story."}]
    xargs = {"vllm_xargs": {"steps": 16, "block_length": 8}}
    full = sdk.chat.completions.create(model=server.model, messages=messages, max_tokens=16, temperature=0.0,
                                       logprobs=True, top_logprobs=2, extra_body=xargs)
    content = full.choices[0].logprobs.content
    assert content and all(entry.logprob <= 0 and len(entry.top_logprobs) == 2 for entry in content)
    stream = sdk.chat.completions.create(model=server.model, messages=messages, max_tokens=16, temperature=0.0,
                                         logprobs=True, top_logprobs=2, stream=True, extra_body=xargs)
    streamed = [entry.logprob for chunk in stream for choice in chunk.choices
                if choice.logprobs and choice.logprobs.content for entry in choice.logprobs.content]
    assert streamed == [entry.logprob for entry in content]
    completion = sdk.completions.create(model=server.model, prompt="hello", max_tokens=16, temperature=0.0,
                                        logprobs=1, extra_body=xargs)
    assert len(completion.choices[0].logprobs.token_logprobs) == len(completion.choices[0].logprobs.tokens) > 0


# --------------------------------------------------------------------------------------
# 6b. structured outputs (the mechanism: tests/engine/test_structured_outputs.py)
# --------------------------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    # A pattern, not only a length: xgrammar 0.2.8's JSON strings admit raw control
    # characters, which a random checkpoint emits and strict JSON parsers refuse.
    "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,5}$"},
                   "count": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["name", "count"],
    "additionalProperties": False,
}


def matches_schema(text: str) -> bool:
    value = json.loads(text)
    return set(value) == {"name", "count"} and re.fullmatch("[a-z]{1,5}", value["name"]) and value["count"] in range(10)


def test_the_openai_sdk_gets_json_for_a_json_schema_sync_and_streaming(server):
    import openai

    sdk = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", timeout=REQUEST_TIMEOUT_S)
    response_format = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}}
    xargs = {"vllm_xargs": {"steps": 32, "block_length": 8}}
    for i, prompt in enumerate(["Name one item.", "Give me a thing.", "Count something."]):
        messages = [{"role": "user", "content": prompt}]
        full = sdk.chat.completions.create(model=server.model, messages=messages, max_tokens=32, temperature=0.0,
                                           response_format=response_format, extra_body=xargs)
        text = full.choices[0].message.content
        assert matches_schema(text) and full.choices[0].finish_reason == "stop", text
        stream = sdk.chat.completions.create(model=server.model, messages=messages, max_tokens=32, temperature=0.0,
                                             response_format=response_format, stream=True, extra_body=xargs)
        streamed = "".join(choice.delta.content or "" for chunk in stream for choice in chunk.choices)
        assert streamed == text


def test_structured_completions_stream_the_same_valid_text(server, client):
    before = metrics(client)
    bodies = [
        dict(prompt="code:", max_tokens=16, temperature=0.0, structured_outputs={"regex": "ID-[0-9]{3}"},
             vllm_xargs={"steps": 16, "block_length": 8}),
        dict(prompt="pick:", max_tokens=16, temperature=0.8, seed=3, structured_outputs={"choice": ["red", "green"]},
             vllm_xargs={"steps": 8, "block_length": 8, "decoding": "threshold", "threshold": 0.5, "cache": "dual"}),
    ]
    for body in bodies:
        full = complete(client, server, **body)["choices"][0]
        events = sse_events(client, server, "/v1/completions", body)
        text, _, finish = streamed_text(events, chat_api=False)
        assert text == full["text"] and finish == full["finish_reason"] == "stop"
    assert re.fullmatch("ID-[0-9]{3}", complete(client, server, **bodies[0])["choices"][0]["text"])
    # Forced tokens have logprob 0 and the rest of their top entries -inf: the
    # response is still JSON.
    choice = complete(client, server, **bodies[0], logprobs=2)["choices"][0]
    assert choice["logprobs"]["token_logprobs"][:3] == [0.0, 0.0, 0.0], choice["logprobs"]
    assert complete(client, server, **bodies[1])["choices"][0]["text"] in ("red", "green")
    after = wait_idle(client, server)
    # "ID-" is forced (single-character tokens): committed without a denoising step.
    forced = "vllm:diffusion_num_grammar_forced_tokens_total"
    assert after[forced] - before.get(forced, 0.0) >= 3 * 3
    assert "vllm:diffusion_num_grammar_returned_tokens_total" in after


# --------------------------------------------------------------------------------------
# 7. client disconnect
# --------------------------------------------------------------------------------------


def test_client_disconnect_aborts_request(server, client):
    wait_idle(client, server)
    steps_name = "vllm:diffusion_num_denoising_steps_total"
    # Four sequences of 192 steps: long enough that the abort lands first even when
    # the API server is slow to notice the disconnect on a loaded 2-core machine.
    copies = 4
    long_body = {
        "model": server.model, "prompt": "hello", "max_tokens": 192, "stream": True,
        "n": copies, "temperature": 0.7, "seed": 1, "vllm_xargs": {"steps": 192, "block_length": 8},
    }
    side_body = {"prompt": "Once upon a time there was", "max_tokens": 16, "vllm_xargs": XARGS}
    side_reference = complete(client, server, **side_body)["choices"][0]["text"]
    before = metrics(client)[steps_name]

    side_result: dict = {}

    def side_request():
        try:
            side_result["out"] = complete(client, server, **side_body)
        except BaseException as err:  # noqa: BLE001 - reported below
            side_result["err"] = err

    with httpx.Client(base_url=server.base_url, timeout=REQUEST_TIMEOUT_S) as dropper:
        with dropper.stream("POST", "/v1/completions", json=long_body) as resp:
            assert resp.status_code == 200
            got = None
            for line in resp.iter_lines():
                if line.startswith("data:"):
                    got = line
                    break
            assert got is not None
            side = threading.Thread(target=side_request)
            side.start()
        # leaving both blocks closes the connection mid-stream
    side.join(timeout=REQUEST_TIMEOUT_S)
    assert not side.is_alive(), "concurrent request hung"
    assert "err" not in side_result, side_result.get("err")
    assert side_result["out"]["choices"][0]["text"] == side_reference

    after = wait_idle(client, server, seconds=10)
    ran = after[steps_name] - before
    # The side request ran 16 steps; the dropped ones must have stopped short of 192 each.
    assert ran < 16 + copies * 192, f"the disconnected request was not aborted ({ran} denoising steps ran)"
    assert server.healthy()


# --------------------------------------------------------------------------------------
# 8. graceful shutdown (must stay the last test: it stops the module's server)
# --------------------------------------------------------------------------------------


def test_graceful_shutdown_with_request_in_flight(server, client):
    body = {"prompt": "hello", "max_tokens": 192, "vllm_xargs": {"steps": 192, "block_length": 8}}
    reference = complete(client, server, **body)["choices"][0]
    first_chunk = threading.Event()
    outcome: dict = {"data": []}

    def in_flight():
        try:
            with httpx.Client(base_url=server.base_url, timeout=REQUEST_TIMEOUT_S) as c:
                with c.stream("POST", "/v1/completions", json={"model": server.model, **body, "stream": True}) as resp:
                    outcome["status"] = resp.status_code
                    for line in resp.iter_lines():
                        if line.startswith("data:"):
                            outcome["data"].append(line[len("data:"):].strip())
                            first_chunk.set()
        except httpx.HTTPError as err:
            outcome["error"] = repr(err)
        finally:
            first_chunk.set()

    thread = threading.Thread(target=in_flight)
    thread.start()
    assert first_chunk.wait(timeout=60), "the in-flight request never started streaming"
    seconds = server.stop()
    thread.join(timeout=60)
    assert not thread.is_alive(), "the client of the in-flight request hung after shutdown"
    assert seconds < 60, f"server took {seconds:.1f} s to exit after SIGTERM"
    assert not server.running
    # Drained, not cut: the in-flight request finished with the full, correct text.
    assert "error" not in outcome, outcome.get("error")
    assert outcome.get("status") == 200
    assert outcome["data"] and outcome["data"][-1] == "[DONE]", outcome["data"][-2:]
    text, _, finish = streamed_text([json.loads(d) for d in outcome["data"][:-1]], chat_api=False)
    assert finish == reference["finish_reason"]
    assert text == reference["text"]
