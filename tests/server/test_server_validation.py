"""The plugin's server refuses what it cannot honour with an HTTP 400 naming the problem
(never a 500), streaming or not, logs a refused stream as one line, and clamps or
defaults canvases as vLLM does for every model (tests/llada_server.py).
"""

from __future__ import annotations

import time

import pytest
from tests.llada_server import (  # noqa: F401 (pytest fixtures among them)
    post,
    client,
    model_dir,
    complete,
    server,
    sse_events,
    tokenizer,
    XARGS,
)



# --------------------------------------------------------------------------------------
# 4. options and validation
# --------------------------------------------------------------------------------------


def test_vllm_xargs_options_accepted(server, client):
    for extra in (
        {"steps": 8, "block_length": 8, "remasking": "random"},
        {"steps": 16, "cfg_scale": 1.0},
        {"steps": 4, "block_length": 16, "cfg_scale": 1},
        {"block_length": 4},
    ):
        out = complete(client, server, prompt="hello", max_tokens=16, seed=1, vllm_xargs=extra, return_token_ids=True)
        choice = out["choices"][0]
        assert choice["finish_reason"] in ("length", "stop")
        assert 0 < len(choice["token_ids"]) <= 16


@pytest.mark.parametrize("switch", ["logits_eos_inf", "confidence_eos_eot_inf"])
def test_boolean_xargs_reach_the_plugin(server, client, switch):
    resp = post(
        client, server, "/v1/completions",
        {"prompt": "hello", "max_tokens": 16, "vllm_xargs": {"steps": 16, switch: True}, "return_token_ids": True},
        expect=None,
    )
    assert resp.status_code == 200, resp.text[:400]
    choice = resp.json()["choices"][0]
    if switch == "logits_eos_inf":
        # EOS is never proposed: the whole canvas is generated.
        assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 16


BAD_REQUESTS = [
    # (id, path, body, words the error message must contain)
    ("gen-not-multiple-of-block", "completions", {"max_tokens": 12, "vllm_xargs": {"block_length": 8}}, ["multiple", "block_length"]),
    ("steps-not-divisible", "completions", {"max_tokens": 16, "vllm_xargs": {"block_length": 8, "steps": 3}}, ["steps=3", "divisible"]),
    ("unknown-key", "completions", {"max_tokens": 16, "vllm_xargs": {"foo": 1}}, ["unknown", "foo"]),
    ("wrong-type", "completions", {"max_tokens": 16, "vllm_xargs": {"steps": "8"}}, ["steps", "int"]),
    ("zero-steps", "completions", {"max_tokens": 16, "vllm_xargs": {"steps": 0}}, ["steps", "positive"]),
    ("bad-remasking", "completions", {"max_tokens": 16, "vllm_xargs": {"remasking": "bogus"}}, ["unknown remasking 'bogus': diffusion option 'remasking' must be low_confidence or random"]),
    ("sampling-field-in-xargs", "completions", {"max_tokens": 16, "vllm_xargs": {"temperature": 0.5}}, ["temperature"]),
    ("dream-option-on-llada", "completions", {"max_tokens": 16, "vllm_xargs": {"alg": "entropy"}}, ["unknown diffusion option 'alg' for llada models ('alg' is a Dream option); LLaDA options are block_length"]),
    ("steps-more-than-canvas", "completions", {"max_tokens": 16, "vllm_xargs": {"steps": 32}}, ["steps=32 is more than the generation length (max_tokens=16", "use at most 16 steps"]),
    ("refresh_interval-without-cache", "completions", {"max_tokens": 16, "vllm_xargs": {"refresh_interval": 2}}, ["diffusion option 'refresh_interval'=2 only applies with a KV cache, but 'cache' is 'none'"]),
    ("delay_step-without-cache", "chat", {"max_tokens": 16, "vllm_xargs": {"delay_step": 1}}, ["diffusion option 'delay_step'=1 only applies with a KV cache"]),
    ("bad-cache", "completions", {"max_tokens": 16, "vllm_xargs": {"cache": "lru"}}, ["unknown cache policy 'lru': diffusion option 'cache' must be none, prefix, dual, sparse or vicinity"]),
    # LLaDA's reference has no top-k/top-p: refused at any temperature and by any route.
    ("top_k-llada-sampled", "completions", {"max_tokens": 16, "temperature": 0.7, "top_k": 50}, ["'top_k'=50 is not supported for LLaDA: its reference decoding has no top-k/top-p filter"]),
    ("top_k-llada-greedy", "completions", {"max_tokens": 16, "temperature": 0, "top_k": 50}, ["'top_k'=50 is not supported for LLaDA"]),
    ("top_p-llada-default-temperature", "chat", {"max_tokens": 16, "top_p": 0.9}, ["'top_p'=0.9 is not supported for LLaDA"]),
    ("top_k-llada-xargs", "completions", {"max_tokens": 16, "vllm_xargs": {"top_k": 50}}, ["'top_k'=50 is not supported for LLaDA"]),
    # vLLM drops min_p at temperature 0 before any plugin hook: the front end sees it.
    ("min_p-greedy", "completions", {"max_tokens": 16, "temperature": 0, "min_p": 0.1}, ["'min_p' is not supported by diffusion decoding"]),
    ("min_p-default-temperature", "chat", {"max_tokens": 16, "min_p": 0.1}, ["'min_p' is not supported by diffusion decoding"]),
    ("logit_bias", "completions", {"max_tokens": 16, "logit_bias": {"5": 1.0}}, ["logit_bias"]),
    # Structured outputs are enforced (tests/engine/test_structured_outputs.py); what the
    # grammar backend cannot compile is its 400.
    ("bad-regex", "completions", {"max_tokens": 16, "structured_outputs": {"regex": "(ab"}}, ["regex"]),
    ("bad-json-schema", "completions", {"max_tokens": 16, "structured_outputs": {"json": "{not json"}}, ["Invalid JSON grammar"]),
    # The ELBO option (its values; a continuation past the prompt: tests/server/test_server.py).
    ("likelihood-unknown", "completions", {"max_tokens": 4, "vllm_xargs": {"likelihood": "exact", "context_tokens": 1}}, ["'likelihood' must be one of elbo"]),
    ("likelihood-without-context", "completions", {"max_tokens": 4, "vllm_xargs": {"likelihood": "elbo"}}, ["needs 'context_tokens'"]),
    ("mc_batch-not-dividing", "completions", {"max_tokens": 4, "vllm_xargs": {"likelihood": "elbo", "context_tokens": 1, "mc_samples": 12, "mc_batch": 5}}, ["'mc_batch' (5) must divide 'mc_samples' (12)"]),
    ("mc_samples-without-likelihood", "chat", {"max_tokens": 4, "vllm_xargs": {"mc_samples": 8}}, ["only apply with 'likelihood'"]),
    ("likelihood-two-prompts", "completions", {"prompt": ["hello", "there"], "max_tokens": 4, "vllm_xargs": {"likelihood": "elbo", "context_tokens": 1}}, ["'likelihood' is returned once per response: send one prompt per request, not 2"]),
    ("likelihood-n-2", "completions", {"prompt": [5, 6, 7], "max_tokens": 4, "n": 2, "vllm_xargs": {"likelihood": "elbo", "context_tokens": 1}}, ["n must be 1"]),
    ("likelihood-text-prompt", "completions", {"prompt": "hello there", "max_tokens": 4, "vllm_xargs": {"likelihood": "elbo", "context_tokens": 1}}, ["'likelihood' needs the prompt as token ids"]),
    ("likelihood-chat", "chat", {"max_tokens": 4, "vllm_xargs": {"likelihood": "elbo", "context_tokens": 1}}, ["'likelihood' scores a completions prompt"]),
    ("presence_penalty", "completions", {"max_tokens": 16, "presence_penalty": 0.5}, ["presence_penalty"]),
    ("frequency_penalty", "chat", {"max_tokens": 16, "frequency_penalty": 0.5}, ["frequency_penalty"]),
    ("repetition_penalty", "completions", {"max_tokens": 16, "repetition_penalty": 1.2}, ["repetition_penalty"]),
    ("min_p", "completions", {"max_tokens": 16, "temperature": 0.5, "min_p": 0.1}, ["min_p"]),
    ("allowed_token_ids", "completions", {"max_tokens": 16, "allowed_token_ids": [5, 6, 7]}, ["allowed_token_ids"]),
    ("bad_words", "completions", {"max_tokens": 16, "bad_words": ["hello"]}, ["bad_words"]),
    ("beam-search", "completions", {"max_tokens": 16, "use_beam_search": True, "n": 2}, ["beam search is not supported"]),
    ("max_tokens-0", "completions", {"max_tokens": 0}, ["max_tokens"]),
    ("max_tokens-negative", "completions", {"max_tokens": -4}, ["max_tokens"]),
    ("max_tokens-huge", "completions", {"max_tokens": 100000}, ["max_tokens"]),
    ("max_tokens-huge-chat", "chat", {"max_tokens": 100000}, ["max_tokens"]),
    ("empty-prompt", "completions", {"prompt": "", "max_tokens": 16}, ["prompt"]),
    ("empty-token-prompt", "completions", {"prompt": [], "max_tokens": 16}, []),
    ("prompt-over-max-model-len", "completions", {"prompt": "abc " * 300, "max_tokens": 16}, ["context length"]),
    ("token-prompt-over-max-model-len", "completions", {"prompt": list(range(3, 250)) * 2, "max_tokens": 16}, ["context length"]),
]


def _bad_body(path: str, body: dict) -> dict:
    if path == "chat":
        return {"messages": [{"role": "user", "content": "hi"}], **body}
    return {"prompt": "hello", **body}


@pytest.mark.parametrize("path,body,words", [b[1:] for b in BAD_REQUESTS], ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_is_400_naming_the_problem(server, client, path, body, words):
    url = "/v1/chat/completions" if path == "chat" else "/v1/completions"
    resp = post(client, server, url, _bad_body(path, body), expect=None)
    assert resp.status_code == 400, f"HTTP {resp.status_code}: {resp.text[:600]}"
    message = resp.json()["error"]["message"]
    assert message
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


# vLLM answers these differently when streaming, for every model (its own checks).
# A streamed ELBO is refused as such before its `n` is looked at.
_STREAM_SPECIFIC = {"beam-search", "empty-token-prompt", "prompt_logprobs", "likelihood-n-2"}


@pytest.mark.parametrize(
    "path,body,words",
    [b[1:] for b in BAD_REQUESTS if b[0] not in _STREAM_SPECIFIC],
    ids=[b[0] for b in BAD_REQUESTS if b[0] not in _STREAM_SPECIFIC],
)
def test_streaming_bad_request_is_the_same_400(server, client, path, body, words):
    """A refused streaming request is an HTTP 400 with the non-streaming
    body, not a 200 whose first event is the error."""
    url = "/v1/chat/completions" if path == "chat" else "/v1/completions"
    plain = post(client, server, url, _bad_body(path, body), expect=None)
    streamed = post(client, server, url, {**_bad_body(path, body), "stream": True}, expect=None)
    assert streamed.status_code == plain.status_code == 400, streamed.text[:600]
    assert streamed.headers["content-type"].startswith("application/json")
    assert streamed.json()["error"]["message"] == plain.json()["error"]["message"]


@pytest.mark.parametrize("path", ["completions", "chat"])
def test_refused_stream_logs_one_line_not_a_traceback(server, client, path):
    """vLLM's stream generator logs the refusal with logger.exception (a
    30-line ERROR traceback); the plugin's log filter leaves one INFO line, as a
    refused non-streaming request (its access line only) gets."""
    url = "/v1/chat/completions" if path == "chat" else "/v1/completions"
    mark = len(server.log_text())
    body = {**_bad_body(path, {"max_tokens": 16, "vllm_xargs": {"foo": 1}}), "stream": True}
    resp = post(client, server, url, body, expect=None)
    assert resp.status_code == 400 and "unknown diffusion option 'foo'" in resp.json()["error"]["message"]
    log = ""
    for _ in range(40):  # the access line is written once the response is sent
        log = server.log_text()[mark:]
        if f'"POST {url} HTTP/1.1" 400' in log:
            break
        time.sleep(0.25)
    lines = [line for line in log.splitlines() if line.strip()]
    refused = [line for line in lines if "Refused streaming request" in line]
    assert len(refused) == 1 and " INFO " in refused[0] and "unknown diffusion option 'foo'" in refused[0], log
    assert "Traceback" not in log and " ERROR " not in log, log


def test_streaming_good_request_still_streams(server, client):
    events = sse_events(client, server, "/v1/completions", {"prompt": "hello", "max_tokens": 16, "vllm_xargs": XARGS})
    assert events and all("error" not in e for e in events)


def test_a_streamed_likelihood_is_refused(server, client):
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 4, "stream": True,
            "vllm_xargs": {"likelihood": "elbo", "context_tokens": 1, "mc_samples": 4}}
    resp = post(client, server, "/v1/completions", body, expect=None)
    assert resp.status_code == 400 and "cannot be streamed" in resp.json()["error"]["message"]


@pytest.mark.parametrize("path", ["completions", "chat"])
def test_best_of_is_not_a_server_error(server, client, path):
    """best_of: vLLM's completions API has no such field (ignored); chat's is unused.
    Either way the answer is a 400 or exactly n choices, never a 5xx."""
    url = "/v1/chat/completions" if path == "chat" else "/v1/completions"
    resp = post(client, server, url, _bad_body(path, {"max_tokens": 16, "best_of": 2, "vllm_xargs": XARGS}), expect=None)
    assert resp.status_code in (200, 400), resp.text[:600]
    if resp.status_code == 200:
        assert len(resp.json()["choices"]) == 1


def test_canvas_is_clamped_to_the_context_like_every_vllm_model(server, client):
    # vLLM's front end lowers max_tokens to max_model_len - prompt_len before any
    # plugin sees the request (for every model); the canvas is then that long.
    prompt = list(range(3, 250))  # 247 tokens; 247 + 16 > 256
    resp = post(client, server, "/v1/completions", {"prompt": prompt, "max_tokens": 16, "return_token_ids": True}, expect=None)
    assert resp.status_code == 200, resp.text[:600]
    choice = resp.json()["choices"][0]
    assert len(choice["token_ids"]) <= 256 - 247
    # An explicit block length that no longer divides the clamped canvas is refused.
    resp = post(
        client, server, "/v1/completions",
        {"prompt": prompt, "max_tokens": 16, "vllm_xargs": {"block_length": 8}}, expect=None,
    )
    assert resp.status_code == 400 and "block_length" in resp.json()["error"]["message"]


def test_max_tokens_over_the_context_is_lowered_not_refused(server, client, tokenizer):
    """max_tokens <= max_model_len with prompt + max_tokens > max_model_len
    is accepted and the canvas lowered to max_model_len - prompt (vLLM's front end,
    for every model; README "Serving").  With EOS suppressed the whole lowered canvas
    comes back, so its length is observable."""
    prompt = list(range(3, 66))  # 63 tokens, like the 63 of 512
    resp = post(
        client, server, "/v1/completions",
        {"prompt": prompt, "max_tokens": 250, "return_token_ids": True,
         "vllm_xargs": {"logits_eos_inf": True, "steps": 193}},
        expect=200,
    )
    out = resp.json()
    assert out["usage"]["prompt_tokens"] == 63
    assert len(out["choices"][0]["token_ids"]) == out["usage"]["completion_tokens"] == 256 - 63
    # max_tokens above max_model_len itself is vLLM's 400.
    resp = post(client, server, "/v1/completions", {"prompt": prompt, "max_tokens": 257}, expect=400)
    assert "max_tokens=257 cannot be greater than max_model_len=256" in resp.json()["error"]["message"]


def test_default_canvas_and_no_cap(server, client):
    """A request without max_tokens gets a 128-position canvas (the tiny checkpoint's
    generation_config.json names no max_new_tokens), and a larger max_tokens is not
    capped to that default: vLLM reads an overridden max_new_tokens as a server-wide
    cap, so the plugin must not set one (it did, lowering max_tokens 192 to 128)."""
    eos_off = {"logits_eos_inf": True, "block_length": 8}
    out = complete(client, server, prompt="hello", return_token_ids=True, vllm_xargs=eos_off)
    assert out["usage"]["completion_tokens"] == 128
    out = complete(client, server, prompt="hello", max_tokens=192, return_token_ids=True, vllm_xargs=eos_off)
    assert out["usage"]["completion_tokens"] == 192
