"""How long a request arriving mid-run waits for its first denoising step, with
several steps per engine call and with one.

    python benchmarks/arrival_wait.py --out benchmarks/results/arrival-wait/intel-2026-12-06

`vllm.LLM` on the shipped model with its engine core in this process: a long request
(256-token canvas, blocks of 32, 256 steps, dual cache) runs; after a random number of
engine steps a short request arrives (32-token canvas, one block of 32 steps).
Measured per arrival, from its `add_request`: the engine steps until one ran its first
denoising step and the wall time to that step's end, and the wall time to its first
streamed token.  One engine per `max_steps_per_call` setting (8, the default,
and 1), the same arrival points for both.  A newcomer that fits is admitted at the next
call, so it waits at most the call that is running when it arrives.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent


def measure(max_steps_per_call: int, arrivals: list[int], prompts: list[list[int]]) -> list[dict]:
    from vllm import LLM, SamplingParams

    from vllm_dllm.default_model import PATH

    llm = LLM(model=str(PATH), dtype="float32", max_model_len=512, max_num_seqs=8, max_num_batched_tokens=2048,
              kv_cache_memory_bytes=64 << 20, enforce_eager=True, seed=0,
              additional_config={"dllm": {"max_steps_per_call": max_steps_per_call}})
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    long = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True,
                          extra_args={"steps": 256, "block_length": 32, "cache": "dual"})
    short = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True,
                           extra_args={"steps": 32, "block_length": 32, "cache": "dual"})
    rows = []
    for n, after in enumerate(arrivals):
        engine.add_request(f"long-{n}", {"prompt_token_ids": prompts[0]}, long)
        for _ in range(after):
            engine.step()
        start = time.perf_counter()
        engine.add_request(f"new-{n}", {"prompt_token_ids": prompts[1]}, short)
        steps, first_step, first_token = 0, None, None
        while first_token is None:
            outputs = engine.step()
            steps += 1
            track = next((t for r, t in scheduler._costs.items() if r.startswith(f"new-{n}")), None)
            started = track is None or track.block or track.block_step or track.has_cache  # None: it finished
            if first_step is None and started:
                first_step = (1e3 * (time.perf_counter() - start), steps)
            if any(o.request_id.startswith(f"new-{n}") and o.outputs[0].token_ids for o in outputs):
                first_token = (1e3 * (time.perf_counter() - start), steps)
        rows.append({"after_engine_steps": after, "wait_ms": first_step[0], "engine_steps": first_step[1],
                     "first_token_ms": first_token[0], "first_token_engine_steps": first_token[1]})
        while engine.has_unfinished_requests():
            engine.step()
    engine.engine_core.shutdown()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--arrivals", type=int, default=12)
    args = ap.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    sys.path.insert(0, str(HERE))
    rng = random.Random(0)
    arrivals = [rng.randrange(1, 10) for _ in range(args.arrivals)]
    prompts = [[10 + (7 * j) % 2000 for j in range(48)], [20 + (11 * j) % 2000 for j in range(24)]]
    result = {"arrivals": arrivals, "settings": {}}
    for setting in (8, 1):
        rows = measure(setting, arrivals, prompts)
        result["settings"][str(setting)] = {
            "rows": rows,
            "median_wait_ms": statistics.median(r["wait_ms"] for r in rows),
            "max_wait_ms": max(r["wait_ms"] for r in rows),
            "max_engine_steps": max(r["engine_steps"] for r in rows),
            "median_first_token_ms": statistics.median(r["first_token_ms"] for r in rows),
            "max_first_token_ms": max(r["first_token_ms"] for r in rows),
        }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = ["| max_steps_per_call | engine steps to its first step (most) | ms to the end of that engine step "
             "(median / max) | ms to its first token (median / max) |", "|---|---|---|---|"]
    for setting, s in result["settings"].items():
        lines.append(f"| {setting} | {s['max_engine_steps']} | {s['median_wait_ms']:.1f} / {s['max_wait_ms']:.1f} "
                     f"| {s['median_first_token_ms']:.1f} / {s['max_first_token_ms']:.1f} |")
    text = "\n".join(lines) + "\n"
    (args.out / "table.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
