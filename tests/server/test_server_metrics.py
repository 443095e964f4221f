"""The plugin's server under observation and load: the diffusion metrics on /metrics
(counters, histograms, KV gauges back to 0 when idle), the task eval CLI against it,
and concurrent valid and invalid requests (tests/llada_server.py).
"""

from __future__ import annotations

import json
import math
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.conftest import random_prompt
from tests.llada_server import (  # noqa: F401 (pytest fixtures among them)
    post,
    client,
    model_dir,
    complete,
    metrics,
    PROMPTS,
    REQUEST_TIMEOUT_S,
    server,
    sse_events,
    streamed_text,
    tokenizer,
    wait_idle,
    XARGS,
)


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
        # Per engine step: a call of a block's 8 denoising steps (max_steps_per_call 8).
        "vllm:diffusion_scheduled_query_tokens_per_step_count": 2,
        "vllm:diffusion_scheduled_query_tokens_per_step_sum": 16 * (prompt_len + 16),
        "vllm:diffusion_logits_rows_per_step_count": 2,
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
    and its Reuse steps are counted."""
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
    """With nothing running the gauges read 0, also when the last request
    was aborted (the engine then runs no denoising step, only clears it)."""
    wait_idle(client, server)
    # ignore_eos and 240 steps: the request runs long enough to be seen running.
    body = {"model": server.model, "prompt": "hello", "max_tokens": 240, "stream": True, "ignore_eos": True,
            "vllm_xargs": {"steps": 240, "block_length": 8, "cache": "dual"}}
    seen = {}
    for _ in range(3):  # a starved front end can deliver the first event late: try again
        with httpx.Client(base_url=server.base_url, timeout=REQUEST_TIMEOUT_S) as dropper:
            with dropper.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                for line in resp.iter_lines():
                    if line.startswith("data:"):
                        break
                # The front end sends a step's tokens before it records the step's
                # stats, so the gauges can lag the first event: poll while it runs.
                for _ in range(40):
                    running = metrics(client)
                    if running["vllm:diffusion_kv_slots"] > 0:
                        seen = running
                        break
                    time.sleep(0.05)
            # leaving both blocks closes the connection mid-stream: vLLM aborts the request
        wait_idle(client, server)
        if seen:
            break
    assert seen and seen["vllm:diffusion_kv_dense_slots"] > 0, "the running request's KV gauges were never seen"
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
    from lab import eval as task_eval

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


def test_eval_decodes_a_llada_server_exactly(server):
    # The server describes its decoding on /metrics (LLaDA2: tests/server/test_llada2_server.py).
    from lab.eval import ServerRunner
    from lab.tasks import ALL_TASKS, Instance

    runner = ServerRunner(server.base_url, None)
    assert runner.exact
    assert runner.default_canvas(ALL_TASKS["addition"], {"block_length": 32}) == 8
    body = runner.body(Instance("addition", "add 1+2=", "3"), 8, {"remasking": "random"})
    assert body["vllm_xargs"] == {"steps": 8, "block_length": 8, "remasking": "random"}


def test_load_mixed_valid_and_invalid(server, client, tokenizer):
    specs = _valid_specs(tokenizer)
    # References: each valid request alone (spot checks: >= 10 distinct requests).
    reference = [_text_of(s["path"], post(client, server, s["path"], s["body"]).json()) for s in specs]
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
    again = post(client, server, specs[0]["path"], specs[0]["body"]).json()
    assert _text_of(specs[0]["path"], again) == reference[0]
