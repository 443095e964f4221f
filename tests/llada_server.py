"""The LLaDA server the test_server* modules run against: `vllm serve` (tests/server_utils.py)
on a tiny random LLaDA checkpoint with the plugin's endpoint checks, as module-scoped
fixtures (each module that imports them starts its own server), and the HTTP helpers
its tests share.  Every wait is bounded in count and time.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.server_utils import ServerProcess

REQUEST_TIMEOUT_S = 120.0
XARGS = {"steps": 16, "block_length": 8}


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
    # VLLM_PLUGINS=dllm loads our endpoint plugin too (vllm_dllm/serving/frontend.py): the
    # streaming 400s and the temperature-0 field checks tested below need it.
    # Structured outputs with the server's defaults (compact JSON for our models).
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

    from vllm_dllm.families import register_hf_classes

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


def post(client, server, path: str, body: dict, expect: int | None = 200) -> httpx.Response:
    body = {"model": server.model, **body}
    resp = client.post(path, json=body)
    if expect is not None and resp.status_code != expect:
        server.fail(
            f"POST {path} {json.dumps(body)[:400]} -> HTTP {resp.status_code}, "
            f"expected {expect}: {resp.text[:800]}"
        )
    return resp


def complete(client, server, **body) -> dict:
    return post(client, server, "/v1/completions", body).json()


def chat(client, server, **body) -> dict:
    return post(client, server, "/v1/chat/completions", body).json()


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
