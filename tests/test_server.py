"""The plugin through vLLM's OpenAI-compatible server, over loopback HTTP.

One `vllm serve` (tests/server_utils.py) on a tiny random LLaDA checkpoint serves
every test of this module; the last test shuts it down with a request in flight.
What is checked is what an API user relies on: usage counts, `max_tokens` as the
canvas, `n`, `stop`, `echo`, the chat template, exactness against the independent
oracle, streaming, option validation (HTTP 400 naming the problem, never 500), the
diffusion metrics, behaviour under concurrent load, client disconnects and graceful
shutdown.  Every wait is bounded in count and time.
"""

from __future__ import annotations

import json
import math
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests import oracle, oracle_model, oracle_rules
from tests.conftest import random_prompt
from tests.tie_free import compare_each_case
from tests.server_utils import ServerProcess

REQUEST_TIMEOUT_S = 120.0
XARGS = {"steps": 16, "block_length": 8}


# --------------------------------------------------------------------------------------
# fixtures and helpers
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from vllm_dllm.tools.make_tiny import make_tiny

    return str(make_tiny("llada", tmp_path_factory.mktemp("server") / "llada", seed=7))


# vLLM 0.32's default shutdown (--shutdown-timeout 0, "abort") force-kills the engine
# core at once; a streaming request then often never ends and uvicorn waits for its
# connection forever (seen with a plain Llama checkpoint too: not the plugin's).  A
# graceful server drains in-flight requests instead, which is what is tested here.
SHUTDOWN_TIMEOUT_S = 30


@pytest.fixture(scope="module")
def server(model_dir):
    # VLLM_PLUGINS=dllm loads our endpoint plugin too (vllm_dllm/frontend.py): the
    # streaming 400s and the temperature-0 field checks tested below need it.
    srv = ServerProcess(model_dir, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S), env={"VLLM_PLUGINS": "dllm"})
    srv.start()
    try:
        # What a scraper sees before the first request (test_metrics_exposed_at_start).
        srv.startup_metrics = parse_metrics(httpx.get(f"{srv.base_url}/metrics", timeout=30).text)
        yield srv
    except BaseException:
        srv.kill()
        raise
    # Graceful shutdown: the last test does it with a request in flight; this bounds
    # every other way the module ends.
    if srv.exit_seconds is None:
        seconds = srv.stop()
        assert seconds < 60, f"server took {seconds:.1f} s to exit after SIGTERM"


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.base_url, timeout=REQUEST_TIMEOUT_S) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    from vllm_dllm.configs import register_hf_classes

    register_hf_classes()
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def special_ids(model_dir, tokenizer):
    config = json.loads(open(f"{model_dir}/config.json").read())
    return {
        "mask": config["mask_token_id"],
        "eos": config["eos_token_id"],
        "eot": tokenizer.get_vocab().get("<|eot_id|>"),
    }


def _post(client, server, path: str, body: dict, expect: int | None = 200) -> httpx.Response:
    body = {"model": server.model, **body}
    resp = client.post(path, json=body)
    if expect is not None and resp.status_code != expect:
        server.fail(
            f"POST {path} {json.dumps(body)[:400]} -> HTTP {resp.status_code}, "
            f"expected {expect}: {resp.text[:800]}"
        )
    return resp


def complete(client, server, **body) -> dict:
    return _post(client, server, "/v1/completions", body).json()


def chat(client, server, **body) -> dict:
    return _post(client, server, "/v1/chat/completions", body).json()


def sse_events(client, server, path: str, body: dict) -> list[dict]:
    """All `data:` events of one streamed request, [DONE] excluded."""
    body = {"model": server.model, **body, "stream": True}
    events, done = [], False
    with client.stream("POST", path, json=body) as resp:
        if resp.status_code != 200:
            resp.read()
            server.fail(f"stream {path} -> HTTP {resp.status_code}: {resp.text[:800]}")
        for line in resp.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                done = True
                break
            events.append(json.loads(data))
            assert len(events) < 10_000, "runaway stream"
    assert done, f"stream {path} ended without [DONE]"
    return events


def streamed_text(events: list[dict], chat_api: bool) -> tuple[str, list[str], str | None]:
    pieces, finish = [], None
    for event in events:
        for choice in event.get("choices", []):
            piece = (choice.get("delta") or {}).get("content") if chat_api else choice.get("text")
            if piece:
                pieces.append(piece)
            if choice.get("finish_reason"):
                finish = choice["finish_reason"]
    return "".join(pieces), pieces, finish


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus samples summed over labels: {sample name: value}."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def metrics(client) -> dict[str, float]:
    resp = client.get("/metrics")
    assert resp.status_code == 200
    return parse_metrics(resp.text)


def wait_idle(client, server, seconds: float = 15.0) -> dict[str, float]:
    """Poll /metrics until nothing runs and no KV block is held (bounded)."""
    deadline = time.monotonic() + seconds
    m = {}
    for _ in range(int(seconds / 0.25) + 1):
        m = metrics(client)
        if m.get("vllm:num_requests_running") == 0 and m.get("vllm:kv_cache_usage_perc") == 0:
            return m
        if time.monotonic() > deadline:
            break
        time.sleep(0.25)
    server.fail(
        f"server not idle after {seconds} s: running={m.get('vllm:num_requests_running')} "
        f"waiting={m.get('vllm:num_requests_waiting')} kv={m.get('vllm:kv_cache_usage_perc')}"
    )


def assert_same_text(served: str, decoded: str) -> None:
    """The server's text equals tokenizer.decode(...), except that vLLM's incremental
    detokenizer holds back an incomplete UTF-8 sequence at the very end (random byte
    tokens), which tokenizer.decode renders as U+FFFD."""
    assert decoded.startswith(served) and set(decoded[len(served):]) <= {"\ufffd"}, (
        f"server text {served!r} != decoded {decoded!r}"
    )


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text).input_ids


def chat_prompt_ids(tokenizer, messages) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


PROMPTS = ["The quick brown fox", "hello", "Once upon a time there was", "1 2 3 4 5"]


# --------------------------------------------------------------------------------------
# 1. completions and chat basics
# --------------------------------------------------------------------------------------


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
    resp = _post(
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
    ("bad-cache", "completions", {"max_tokens": 16, "vllm_xargs": {"cache": "lru"}}, ["unknown cache policy 'lru': diffusion option 'cache' must be none, prefix, dual or sparse"]),
    # LLaDA's reference has no top-k/top-p: refused at any temperature and by any route.
    ("top_k-llada-sampled", "completions", {"max_tokens": 16, "temperature": 0.7, "top_k": 50}, ["'top_k'=50 is not supported for LLaDA: its reference decoding has no top-k/top-p filter"]),
    ("top_k-llada-greedy", "completions", {"max_tokens": 16, "temperature": 0, "top_k": 50}, ["'top_k'=50 is not supported for LLaDA"]),
    ("top_p-llada-default-temperature", "chat", {"max_tokens": 16, "top_p": 0.9}, ["'top_p'=0.9 is not supported for LLaDA"]),
    ("top_k-llada-xargs", "completions", {"max_tokens": 16, "vllm_xargs": {"top_k": 50}}, ["'top_k'=50 is not supported for LLaDA"]),
    # vLLM drops min_p at temperature 0 before any plugin hook: the front end sees it.
    ("min_p-greedy", "completions", {"max_tokens": 16, "temperature": 0, "min_p": 0.1}, ["'min_p' is not supported by diffusion decoding"]),
    ("min_p-default-temperature", "chat", {"max_tokens": 16, "min_p": 0.1}, ["'min_p' is not supported by diffusion decoding"]),
    ("logit_bias", "completions", {"max_tokens": 16, "logit_bias": {"5": 1.0}}, ["logit_bias"]),
    ("json_schema", "chat", {"max_tokens": 16, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}}, ["structured_outputs"]),
    ("json_object", "completions", {"max_tokens": 16, "response_format": {"type": "json_object"}}, ["structured_outputs"]),
    ("structured_outputs", "completions", {"max_tokens": 16, "structured_outputs": {"choice": ["yes", "no"]}}, ["structured_outputs"]),
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
    resp = _post(client, server, url, _bad_body(path, body), expect=None)
    assert resp.status_code == 400, f"HTTP {resp.status_code}: {resp.text[:600]}"
    message = resp.json()["error"]["message"]
    assert message
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


# vLLM answers these differently when streaming, for every model (its own checks).
_STREAM_SPECIFIC = {"beam-search", "empty-token-prompt", "prompt_logprobs"}


@pytest.mark.parametrize(
    "path,body,words",
    [b[1:] for b in BAD_REQUESTS if b[0] not in _STREAM_SPECIFIC],
    ids=[b[0] for b in BAD_REQUESTS if b[0] not in _STREAM_SPECIFIC],
)
def test_streaming_bad_request_is_the_same_400(server, client, path, body, words):
    """Issue 15: a refused streaming request is an HTTP 400 with the non-streaming
    body, not a 200 whose first event is the error."""
    url = "/v1/chat/completions" if path == "chat" else "/v1/completions"
    plain = _post(client, server, url, _bad_body(path, body), expect=None)
    streamed = _post(client, server, url, {**_bad_body(path, body), "stream": True}, expect=None)
    assert streamed.status_code == plain.status_code == 400, streamed.text[:600]
    assert streamed.headers["content-type"].startswith("application/json")
    assert streamed.json()["error"]["message"] == plain.json()["error"]["message"]


@pytest.mark.parametrize("path", ["completions", "chat"])
def test_refused_stream_logs_one_line_not_a_traceback(server, client, path):
    """Issue 28: vLLM's stream generator logs the refusal with logger.exception (a
    30-line ERROR traceback); the plugin's log filter leaves one INFO line, as a
    refused non-streaming request (its access line only) gets."""
    url = "/v1/chat/completions" if path == "chat" else "/v1/completions"
    mark = len(server.log_text())
    body = {**_bad_body(path, {"max_tokens": 16, "vllm_xargs": {"foo": 1}}), "stream": True}
    resp = _post(client, server, url, body, expect=None)
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


@pytest.mark.parametrize("path", ["completions", "chat"])
def test_best_of_is_not_a_server_error(server, client, path):
    """best_of: vLLM's completions API has no such field (ignored); chat's is unused.
    Either way the answer is a 400 or exactly n choices, never a 5xx."""
    url = "/v1/chat/completions" if path == "chat" else "/v1/completions"
    resp = _post(client, server, url, _bad_body(path, {"max_tokens": 16, "best_of": 2, "vllm_xargs": XARGS}), expect=None)
    assert resp.status_code in (200, 400), resp.text[:600]
    if resp.status_code == 200:
        assert len(resp.json()["choices"]) == 1


def test_canvas_is_clamped_to_the_context_like_every_vllm_model(server, client):
    # vLLM's front end lowers max_tokens to max_model_len - prompt_len before any
    # plugin sees the request (for every model); the canvas is then that long.
    prompt = list(range(3, 250))  # 247 tokens; 247 + 16 > 256
    resp = _post(client, server, "/v1/completions", {"prompt": prompt, "max_tokens": 16, "return_token_ids": True}, expect=None)
    assert resp.status_code == 200, resp.text[:600]
    choice = resp.json()["choices"][0]
    assert len(choice["token_ids"]) <= 256 - 247
    # An explicit block length that no longer divides the clamped canvas is refused.
    resp = _post(
        client, server, "/v1/completions",
        {"prompt": prompt, "max_tokens": 16, "vllm_xargs": {"block_length": 8}}, expect=None,
    )
    assert resp.status_code == 400 and "block_length" in resp.json()["error"]["message"]


def test_max_tokens_over_the_context_is_lowered_not_refused(server, client, tokenizer):
    """Issue 15: max_tokens <= max_model_len with prompt + max_tokens > max_model_len
    is accepted and the canvas lowered to max_model_len - prompt (vLLM's front end,
    for every model; README "Serving").  With EOS suppressed the whole lowered canvas
    comes back, so its length is observable."""
    prompt = list(range(3, 66))  # 63 tokens, like the 63 of 512
    resp = _post(
        client, server, "/v1/completions",
        {"prompt": prompt, "max_tokens": 250, "return_token_ids": True,
         "vllm_xargs": {"logits_eos_inf": True, "steps": 193}},
        expect=200,
    )
    out = resp.json()
    assert out["usage"]["prompt_tokens"] == 63
    assert len(out["choices"][0]["token_ids"]) == out["usage"]["completion_tokens"] == 256 - 63
    # max_tokens above max_model_len itself is vLLM's 400.
    resp = _post(client, server, "/v1/completions", {"prompt": prompt, "max_tokens": 257}, expect=400)
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


# --------------------------------------------------------------------------------------
# 5. metrics
# --------------------------------------------------------------------------------------

DIFFUSION_COUNTERS = [
    "vllm:diffusion_num_denoising_steps_total",
    "vllm:diffusion_num_canvas_positions_total",
    "vllm:diffusion_num_committed_tokens_total",
    "vllm:diffusion_num_refresh_steps_total",
    "vllm:diffusion_num_reuse_steps_total",
    "vllm:diffusion_num_delayed_steps_total",
    "vllm:diffusion_num_cache_rebuilds_total",
    "vllm:diffusion_kv_slots",
    "vllm:diffusion_kv_dense_slots",
]
DIFFUSION_HISTOGRAMS = [
    "vllm:diffusion_scheduled_query_tokens_per_step",
    "vllm:diffusion_logits_rows_per_step",
]


def _missing_diffusion_metrics(samples: dict[str, float]) -> list[str]:
    names = DIFFUSION_COUNTERS + [f"{h}_{part}" for h in DIFFUSION_HISTOGRAMS for part in ("count", "sum")]
    return [name for name in names if name not in samples]


def test_metrics_exposed_at_start(server):
    assert not _missing_diffusion_metrics(server.startup_metrics)


def test_metrics_count_one_request(server, client, tokenizer):
    wait_idle(client, server)
    before = metrics(client)  # (the series may not exist yet: counted as 0)

    prompt = "The quick brown fox"
    out = complete(
        client, server, prompt=prompt, max_tokens=16, return_token_ids=True,
        vllm_xargs={"steps": 16, "block_length": 8},
    )
    # (this prompt draws no EOS: all 16 steps run over the whole canvas)
    assert out["choices"][0]["finish_reason"] == "length", "pick a prompt that draws no EOS"
    completion_tokens = out["usage"]["completion_tokens"]
    assert completion_tokens == 16
    prompt_len = out["usage"]["prompt_tokens"]

    expected = {
        "vllm:diffusion_num_denoising_steps_total": 16,
        "vllm:diffusion_num_canvas_positions_total": 16 * 16,
        "vllm:diffusion_num_committed_tokens_total": completion_tokens,
        # Exact mode recomputes every step.
        "vllm:diffusion_num_refresh_steps_total": 16,
        "vllm:diffusion_num_reuse_steps_total": 0,
        "vllm:diffusion_num_delayed_steps_total": 0,  # alone, it never waits for budget
        "vllm:diffusion_scheduled_query_tokens_per_step_count": 16,
        "vllm:diffusion_scheduled_query_tokens_per_step_sum": 16 * (prompt_len + 16),
        "vllm:diffusion_logits_rows_per_step_count": 16,
        # Masked positions of the current block only: 8 + 7 + ... + 1 per block, two blocks.
        "vllm:diffusion_logits_rows_per_step_sum": 2 * sum(range(1, 9)),
    }
    deltas, after = {}, {}
    for _ in range(40):  # the front end records stats as outputs arrive: poll briefly
        after = metrics(client)
        deltas = {name: after.get(name, 0) - before.get(name, 0) for name in expected}
        if deltas == expected:
            break
        time.sleep(0.25)
    assert not _missing_diffusion_metrics(after), "diffusion metrics missing from /metrics"
    assert deltas == expected


def _first_event_then(client, server, body: dict, during) -> tuple[object, dict]:
    """Stream `body`; once its first event arrives (the request is running), call
    during().  Returns what it returned and the stream's usage."""
    body = {"model": server.model, **body, "stream": True, "stream_options": {"include_usage": True}}
    seen, usage = None, None
    with client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            if seen is None:
                seen = during()
            usage = json.loads(line[len("data:"):]).get("usage") or usage
    return seen, usage


KV_GAUGES = ("vllm:diffusion_kv_slots", "vllm:diffusion_kv_dense_slots")


def wait_kv_gauges_zero(client, server, seconds: float = 15.0) -> None:
    m = {}
    for _ in range(int(seconds / 0.25) + 1):
        m = metrics(client)
        if all(m.get(name) == 0 for name in KV_GAUGES):
            return
        time.sleep(0.25)
    server.fail(f"KV gauges not 0 with nothing running: {({name: m.get(name) for name in KV_GAUGES})}")


def test_metrics_show_a_sparse_request_kv_footprint(server, client):
    """A sparse request holds its kept positions plus its block; the gauges show it
    next to what the dense cache would hold while it runs, 0 once nothing runs
    (issue 28), and its Reuse steps are counted."""
    wait_idle(client, server)
    before = metrics(client)
    # 30 blocks of 8, so the request still runs when the first block has streamed.
    body = {"prompt": "The quick brown fox", "max_tokens": 240, "ignore_eos": True,
            "vllm_xargs": {"steps": 240, "block_length": 8, "cache": "sparse", "retention": 0.5}}
    during, usage = _first_event_then(client, server, body, lambda: metrics(client))
    assert usage["completion_tokens"] == 240  # every step ran (no early EOS)
    seq_len = usage["prompt_tokens"] + 240
    expected = {
        "vllm:diffusion_kv_slots": math.ceil(0.5 * (seq_len - 8)) + 8,
        "vllm:diffusion_kv_dense_slots": seq_len,
    }
    assert {name: during.get(name) for name in expected} == expected
    wait_kv_gauges_zero(client, server)
    # Steps 0 and 1 of each block refresh (the delayed update), 2..7 reuse.
    expected_deltas = {"vllm:diffusion_num_reuse_steps_total": 30 * 6, "vllm:diffusion_num_refresh_steps_total": 30 * 2}
    deltas = {}
    for _ in range(40):  # the front end records stats as outputs arrive: poll briefly
        after = metrics(client)
        deltas = {name: after.get(name, 0) - before.get(name, 0) for name in expected_deltas}
        if deltas == expected_deltas:
            break
        time.sleep(0.25)
    assert deltas == expected_deltas


def test_kv_gauges_fall_to_zero_after_an_abort(server, client):
    """Issue 28: with nothing running the gauges read 0, also when the last request
    was aborted (the engine then runs no denoising step, only clears it)."""
    wait_idle(client, server)
    body = {"model": server.model, "prompt": "hello", "max_tokens": 192, "stream": True,
            "vllm_xargs": {"steps": 192, "block_length": 8, "cache": "dual"}}
    with httpx.Client(base_url=server.base_url, timeout=REQUEST_TIMEOUT_S) as dropper:
        with dropper.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data:"):
                    break
            running = metrics(client)
        # leaving both blocks closes the connection mid-stream: vLLM aborts the request
    assert running["vllm:diffusion_kv_slots"] > 0 and running["vllm:diffusion_kv_dense_slots"] > 0
    wait_idle(client, server)
    wait_kv_gauges_zero(client, server)


# --------------------------------------------------------------------------------------
# 6. load
# --------------------------------------------------------------------------------------


def _valid_specs(tokenizer) -> list[dict]:
    rng = random.Random(99)
    specs = []
    for i, prompt in enumerate(PROMPTS):
        specs.append({"path": "/v1/completions", "body": {"prompt": prompt, "max_tokens": 16, "vllm_xargs": XARGS}})
        specs.append({"path": "/v1/completions", "body": {"prompt": prompt, "max_tokens": 8, "temperature": 0.7, "seed": 10 + i, "vllm_xargs": {"steps": 8}}})
    for n in (6, 11):
        specs.append({"path": "/v1/completions", "body": {"prompt": random_prompt(rng, n), "max_tokens": 8, "vllm_xargs": {"steps": 4, "block_length": 4}}})
    for content in ("hi", "What is the capital of France?", "Count to three."):
        specs.append({"path": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": content}], "max_tokens": 16, "vllm_xargs": XARGS}})
    specs.append({"path": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "Pick a number."}], "max_tokens": 8, "temperature": 0.9, "seed": 5}})
    return specs


LOAD_INVALID = [
    ({"prompt": "hi", "max_tokens": 12, "vllm_xargs": {"block_length": 8}}, "multiple"),
    ({"prompt": "hi", "max_tokens": 8, "vllm_xargs": {"nope": 1}}, "nope"),
    ({"prompt": "hi", "max_tokens": 8, "vllm_xargs": {"steps": "4"}}, "steps"),
    ({"prompt": "hi", "max_tokens": 8, "logit_bias": {"3": 2.0}}, "logit_bias"),
    ({"prompt": "hi", "max_tokens": 8, "presence_penalty": 0.5}, "presence_penalty"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "abc " * 300, "max_tokens": 8}, "context length"),
]


def _text_of(path: str, payload: dict) -> str:
    choice = payload["choices"][0]
    return choice["message"]["content"] if "chat" in path else choice["text"]


def test_eval_cli_against_a_running_server(server, tmp_path):
    # The task evaluation drives the server through chat completions; the tiny model is
    # random, so only the accounting is checked here (accuracy: test_task_model.py).
    from vllm_dllm import eval as task_eval

    out = tmp_path / "eval.json"
    assert task_eval.main(["--base-url", server.base_url, "--task", "addition", "--n", "4", "--out", str(out)]) == 0
    [result] = json.loads(out.read_text())["results"]
    assert result["task"] == "addition" and result["n"] == 4
    assert 0 <= result["correct"] <= 4
    low, high = result["ci95"]
    assert 0.0 <= low <= result["accuracy"] <= high <= 1.0
    # Exact decoding by default: at most one step per canvas position of each request
    # (a request ends once its end of text is committed), at least one per token.
    assert result["steps_per_token"] is None or result["steps_per_token"] >= 1.0
    assert 0 < result["denoising_steps"] <= 4 * 8


def test_load_mixed_valid_and_invalid(server, client, tokenizer):
    specs = _valid_specs(tokenizer)
    # References: each valid request alone (spot checks: >= 10 distinct requests).
    reference = [_text_of(s["path"], _post(client, server, s["path"], s["body"]).json()) for s in specs]
    assert len(reference) >= 10

    rng = random.Random(7)
    jobs = []
    for i in range(200):
        if i % 4 == 3:
            body, word = LOAD_INVALID[rng.randrange(len(LOAD_INVALID))]
            jobs.append(("invalid", "/v1/completions", body, word, False))
        else:
            k = rng.randrange(len(specs))
            jobs.append((k, specs[k]["path"], specs[k]["body"], None, i % 3 == 0))

    pool_client = httpx.Client(
        base_url=server.base_url, timeout=REQUEST_TIMEOUT_S,
        limits=httpx.Limits(max_connections=32, max_keepalive_connections=32),
    )

    def run(job):
        kind, path, body, word, stream = job
        try:
            if stream:
                text, _, _ = streamed_text(sse_events(pool_client, server, path, body), chat_api="chat" in path)
                return job, 200, text
            resp = pool_client.post(path, json={"model": server.model, **body})
            if resp.status_code == 200:
                return job, 200, _text_of(path, resp.json())
            return job, resp.status_code, resp.text
        except Exception as err:  # reported below with the job
            return job, None, repr(err)

    started = time.monotonic()
    with pool_client, ThreadPoolExecutor(max_workers=32) as pool:
        results = list(pool.map(run, jobs))
    elapsed = time.monotonic() - started

    problems = []
    for (kind, path, body, word, stream), status, text in results:
        if kind == "invalid":
            if status != 400:
                problems.append(f"invalid {body} -> {status}: {text[:200]}")
                continue
            message = json.loads(text)["error"]["message"]
            if word not in message:
                problems.append(f"invalid {body}: {word!r} not in {message!r}")
        elif status != 200 or text != reference[kind]:
            problems.append(f"valid #{kind} stream={stream} {body} -> {status}: {text[:200]!r} != {reference[kind][:200]!r}")
    assert not problems, f"{len(problems)} of 200 requests wrong (in {elapsed:.0f} s):\n" + "\n".join(problems[:15])
    assert server.healthy()
    wait_idle(client, server, seconds=10)
    # Still serving correctly afterwards.
    again = _post(client, server, specs[0]["path"], specs[0]["body"]).json()
    assert _text_of(specs[0]["path"], again) == reference[0]


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
