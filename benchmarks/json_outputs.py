"""Structured outputs as a client meets them: `make serve` with its defaults, the openai SDK.

    .venv/bin/python benchmarks/json_outputs.py --out benchmarks/results/json-outputs/NAME

Starts `make serve` (the shipped task model, default settings) and sends the same
addition prompts (lab/tasks.py) as four kinds of chat request, without
max_tokens (the server's default canvas):

* plain: unconstrained;
* json_schema: `response_format` json_schema `{"sum": integer}`;
* json_object: `response_format` json_object;
* regex: `structured_outputs` regex `[0-9]{1,8}`.

The kinds run interleaved in rounds (every kind once per round, `--per-round` requests
each at `--concurrency`), so drift on a shared machine falls on all of them alike.
Reports per kind: the share of answers that parse (JSON) or match (regex), the
median latency and its ratio to plain's, the answers that are right (plain and
regex: the answer; json_schema: its "sum"), finish reasons, and the server's grammar
counters (tokens forced, tokens returned to the mask) over the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # lab/ sits at the repository root

from lab.tasks import Addition  # noqa: E402

MODEL = "vllm-dllm-task"
SUM_SCHEMA = {"type": "object", "properties": {"sum": {"type": "integer"}}, "required": ["sum"]}
REGEX = "[0-9]{1,8}"
KINDS = ("plain", "json_schema", "json_object", "regex")
COUNTERS = ("vllm:diffusion_num_grammar_forced_tokens_total", "vllm:diffusion_num_grammar_returned_tokens_total")


def request_kwargs(kind: str) -> dict:
    if kind == "json_schema":
        return {"response_format": {"type": "json_schema",
                                    "json_schema": {"name": "sum", "schema": SUM_SCHEMA}}}
    if kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if kind == "regex":
        return {"extra_body": {"structured_outputs": {"regex": REGEX}}}
    return {}


def judge(kind: str, text: str, answer: str) -> tuple[bool, bool]:
    """(well-formed, right) of one reply."""
    if kind in ("plain", "regex"):
        formed = kind == "plain" or re.fullmatch(REGEX, text) is not None
        return formed, text.strip() == answer
    try:
        value = json.loads(text)
    except ValueError:
        return False, False
    if kind == "json_object":
        return isinstance(value, dict), False
    formed = isinstance(value, dict) and type(value.get("sum")) is int
    return formed, formed and str(value["sum"]) == answer


def counters(base_url: str) -> dict[str, float]:
    text = urllib.request.urlopen(base_url.removesuffix("/v1") + "/metrics", timeout=10).read().decode()
    out = {}
    for name in COUNTERS:
        out[name] = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))
    return out


async def run_kind(client, kind: str, prompts, concurrency: int) -> list[dict]:
    gate = asyncio.Semaphore(concurrency)

    async def one(instance):
        async with gate:
            start = time.perf_counter()
            reply = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": instance.prompt}], temperature=0,
                **request_kwargs(kind))
            latency = time.perf_counter() - start
        choice = reply.choices[0]
        text = choice.message.content or ""
        formed, right = judge(kind, text, instance.answer)
        return {"kind": kind, "prompt": instance.prompt, "text": text, "finish": choice.finish_reason,
                "tokens": reply.usage.completion_tokens, "latency_s": latency, "formed": formed, "right": right}

    return await asyncio.gather(*(one(p) for p in prompts))


async def workload(base_url: str, rounds: int, per_round: int, concurrency: int, seed: int) -> list[dict]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="none", timeout=600)
    rng = random.Random(seed)
    task = Addition()
    rows = []
    await run_kind(client, "plain", [task.draw(rng) for _ in range(concurrency)], concurrency)  # warm-up
    for r in range(rounds):
        prompts = [task.draw(rng) for _ in range(per_round)]
        for kind in KINDS:
            for row in await run_kind(client, kind, prompts, concurrency):
                rows.append({**row, "round": r})
    return rows


def summary(rows: list[dict]) -> dict:
    plain_median = statistics.median(r["latency_s"] for r in rows if r["kind"] == "plain")
    out = {}
    for kind in KINDS:
        mine = [r for r in rows if r["kind"] == kind]
        median = statistics.median(r["latency_s"] for r in mine)
        finishes: dict[str, int] = {}
        for r in mine:
            finishes[r["finish"]] = finishes.get(r["finish"], 0) + 1
        out[kind] = {
            "requests": len(mine),
            "well_formed": sum(r["formed"] for r in mine),
            "right": sum(r["right"] for r in mine),
            "median_latency_s": median,
            "latency_x_plain": median / plain_median,
            "median_tokens": statistics.median(r["tokens"] for r in mine),
            "finish_reasons": finishes,
        }
    return out


def table(result: dict) -> str:
    lines = ["| kind | requests | well-formed | right | median latency s | x plain | median tokens | finish |",
             "|---|---|---|---|---|---|---|---|"]
    for kind, s in result["summary"].items():
        finish = ", ".join(f"{k} {v}" for k, v in sorted(s["finish_reasons"].items()))
        right = "-" if kind == "json_object" else str(s["right"])
        lines.append(f"| {kind} | {s['requests']} | {s['well_formed']} | {right} | {s['median_latency_s']:.3f} "
                     f"| {s['latency_x_plain']:.2f} | {s['median_tokens']:g} | {finish} |")
    grammar = result["grammar_counters"]
    lines.append("")
    lines.append(f"Grammar counters over the run: {grammar[COUNTERS[0]]:.0f} tokens forced, "
                 f"{grammar[COUNTERS[1]]:.0f} returned to the mask.")
    return "\n".join(lines) + "\n"


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def wait_ready(base_url: str, server: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"make serve exited with {server.returncode}")
        try:
            urllib.request.urlopen(base_url.removesuffix("/v1") + "/health", timeout=2)
            return
        except OSError:
            time.sleep(1)
    raise TimeoutError("the server did not become healthy")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--port", type=int, default=8031)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--per-round", type=int, default=50)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    base_url = f"http://127.0.0.1:{args.port}/v1"
    log = open(args.out / "server.log", "w")
    server = subprocess.Popen(["make", "-s", "serve", f"PORT={args.port}", "HOST=127.0.0.1"], cwd=ROOT,
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ready(base_url, server)
        before = counters(base_url)
        rows = asyncio.run(workload(base_url, args.rounds, args.per_round, args.concurrency, args.seed))
        after = counters(base_url)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    result = {
        "command": "python benchmarks/json_outputs.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count()},
        "settings": {"rounds": args.rounds, "per_round": args.per_round, "concurrency": args.concurrency,
                     "seed": args.seed},
        "summary": summary(rows),
        "grammar_counters": {k: after[k] - before[k] for k in COUNTERS},
    }
    (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (args.out / "summary.md").write_text(table(result))
    print(table(result), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
