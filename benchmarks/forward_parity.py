"""The plugin against the plain loop, each generate split into the model's forward and
everything else, in one process, interleaved (where a step's time goes).

    python benchmarks/forward_parity.py --out benchmarks/results/plain-loop/forward-parity/n1
    python benchmarks/forward_parity.py --num-requests 32 --out .../n32   # plain loop: batches of 8
        [--order length|arrival] [--rounds 6] [--per-round 3] [--dtype float32] [--batch 8]

Both sides run the workload of benchmarks/plain_loop.py (the shipped model, held-out
task prompts in the chat frame, a 32-token canvas, block 8, 32 steps, dual cache,
greedy, equal work).  The plain loop batches the prompts sorted by length (its least
padding) or in arrival order, as Fast-dLLM's code does (plain_loop.py's `--orders`).  The plugin is `vllm.LLM` with its engine
core in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so both sides share the
process, its OpenMP threads and the machine's moment: the rounds alternate the two
sides, and this VM's speed, which drifts by up to 2x between invocations, moves both
alike.

Each generate's wall time splits into the model forwards (the plugin's timed in the
worker by worker_timing.TimingExtension; the plain loop's by wrapping its forward) and
the rest: for the plugin the step engine's layout, inputs, decoding rule and LM head
plus vLLM's scheduler and output processing; for the plain loop its softmax, argmax and
top-k.  The plain loop's forward ends in its LM head over the step's queries; the
plugin's LM head runs over the masked candidates only and is counted in its rest.
Steps are denoising steps (forwards); the plugin runs several in one engine call
(the server's `max_steps_per_call`, default 8; `--max-steps-per-call` sets it here).
The summary's last figure is what the plugin / plain ratio would be if the plugin's
generate were its forwards alone: the most any cut of the engine loop can reach.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--rounds", type=int, default=6, help="alternations of the two sides")
    ap.add_argument("--per-round", type=int, default=3, help="generates per side per round")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--num-requests", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8, help="the plain loop's batch (at most --num-requests)")
    ap.add_argument("--order", default="length", choices=("length", "arrival"),
                    help="the plain loop's batches: prompts sorted by length (its least padding) or as they come")
    ap.add_argument("--seed", type=int, default=0, help="which held-out prompts (engine_overhead.build_prompts)")
    ap.add_argument("--max-steps-per-call", type=int, default=None,
                    help="the plugin's denoising steps per engine call (default: the server's)")
    args = ap.parse_args(argv)
    if min(args.rounds, args.per_round, args.num_requests, args.batch) < 1:
        ap.error("--rounds, --per-round, --num-requests and --batch must be at least 1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    sys.path.insert(0, str(HERE))
    result = measure(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    text = table(result)
    (args.out / "table.md").write_text(text)
    print(text)
    return 0


def measure(args) -> dict:
    import torch
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    import engine_overhead as eo
    import plain_loop as pl
    from vllm_dllm.default_model import PATH

    prompts, tasks = eo.build_prompts(AutoTokenizer.from_pretrained(str(PATH)), args.num_requests, args.seed)
    batch = min(args.batch, len(prompts))
    batched = sorted(prompts, key=len) if args.order == "length" else prompts
    refresh_tokens = sum(len(p) + eo.CANVAS for p in prompts)  # every request refreshing at once
    llm = LLM(model=str(PATH), dtype=args.dtype, max_model_len=512, max_num_seqs=max(len(prompts), 32),
              max_num_batched_tokens=max(2048, refresh_tokens),
              kv_cache_memory_bytes=256 << 20, gpu_memory_utilization=0.3, enforce_eager=True, seed=0,
              worker_extension_cls="worker_timing.TimingExtension",
              additional_config=({"dllm": {"max_steps_per_call": args.max_steps_per_call}}
                                 if args.max_steps_per_call is not None else {}))
    info = llm.collective_rpc("dllm_bench_install")[0]
    params = SamplingParams(max_tokens=eo.CANVAS, temperature=0.0, ignore_eos=True, extra_args=dict(eo.XARGS))
    inputs = [{"prompt_token_ids": p} for p in prompts]
    plain = TimedPlain(pathlib.Path(PATH), args.dtype)

    def plugin_once() -> dict:
        llm.collective_rpc("dllm_bench_reset")
        start = time.perf_counter()
        outs = llm.generate(inputs, params, use_tqdm=False)
        end = time.perf_counter()
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        run = eo.summarize(start, end, tokens, llm.collective_rpc("dllm_bench_stats")[0], len(prompts), eo.CANVAS)
        return {"wall_s": run["wall_s"], "steps": run["forwards"], "calls": run["steps"],
                "tokens": run["committed_tokens"], "breakdown_ms": run["breakdown_ms"]}

    def plain_once() -> dict:
        plain.forward_s, plain.forward_calls = 0.0, 0
        start = time.perf_counter()
        tokens = 0
        with torch.inference_mode():
            for first in range(0, len(batched), batch):
                canvas = pl.plain_generate(plain, batched[first : first + batch])
                assert not bool((canvas == plain.mask_id).any()), "a canvas position was left masked"
                tokens += canvas.numel()
        wall = time.perf_counter() - start
        return {"wall_s": wall, "steps": plain.forward_calls, "calls": plain.forward_calls, "tokens": tokens,
                "breakdown_ms": {"forward": 1e3 * plain.forward_s}}

    plugin_once(), plain_once()  # warm-up
    plugin_runs, plain_runs = [], []
    for _ in range(args.rounds):
        plugin_runs += [plugin_once() for _ in range(args.per_round)]
        plain_runs += [plain_once() for _ in range(args.per_round)]
    return {
        "workload": {"num_requests": len(prompts), "plain_batch": batch, "plain_order": args.order,
                     "prompt_tokens": [len(p) for p in prompts],
                     "tasks": {t: tasks.count(t) for t in sorted(set(tasks))}, "canvas": eo.CANVAS,
                     "xargs": eo.XARGS, "dtype": args.dtype, "max_steps_per_call": args.max_steps_per_call,
                     "rounds": args.rounds, "per_round": args.per_round},
        "torch_threads": torch.get_num_threads(),
        "worker": {k: info[k] for k in ("torch_num_threads", "worker_cpus_allowed", "omp_env")},
        "cpu": cpu_model(),
        "plugin": side(plugin_runs, ("forward", "runner_other", "between_steps", "head", "tail")),
        "plain": side(plain_runs, ("forward",)),
        "plugin_runs": plugin_runs,
        "plain_runs": plain_runs,
    }


class TimedPlain:
    """plain_loop.PlainLLaDA with its forward's time and calls counted."""

    def __init__(self, path: pathlib.Path, dtype: str):
        import plain_loop as pl

        self.model = pl.PlainLLaDA(path, dtype)
        self.mask_id = self.model.mask_id
        self.forward_s, self.forward_calls = 0.0, 0

    def forward(self, *args, **kwargs):
        start = time.perf_counter()
        out = self.model.forward(*args, **kwargs)
        self.forward_s += time.perf_counter() - start
        self.forward_calls += 1
        return out


def side(runs: list[dict], parts: tuple[str, ...]) -> dict:
    """Medians over the generates: committed tokens/s, and ms per generate of the wall
    time and of each part of it (the plugin's step count can vary with admission)."""
    def median(values):
        values = sorted(values)
        return values[len(values) // 2]

    out = {"steps": median(r["steps"] for r in runs), "calls": median(r["calls"] for r in runs), "tokens_per_s": median(r["tokens"] / r["wall_s"] for r in runs),
           "wall_ms": median(1e3 * r["wall_s"] for r in runs)}
    for part in parts:
        out[f"{part}_ms"] = median(r["breakdown_ms"][part] for r in runs)
    out["rest_ms"] = median(1e3 * r["wall_s"] - r["breakdown_ms"]["forward"] for r in runs)
    return out


def cpu_model() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} x {os.cpu_count()}"
    except OSError:
        pass
    return "?"


def table(result: dict) -> str:
    plugin, plain = result["plugin"], result["plain"]
    w = result["workload"]
    requests = w["num_requests"]
    plain_side = "plain loop" + (f" (batches of {w['plain_batch']}, {w['plain_order']} order)" if requests > 1 else "")
    rows = [("plugin", plugin), (plain_side, plain)]
    lines = [
        f"{result['cpu']}, {w['dtype']}, {requests} request(s) at once, {w['rounds']} rounds x {w['per_round']} "
        "generates per side alternating in one process; medians per generate",
        "",
        "| side | tok/s | steps | engine calls | ms | forward ms | rest ms | forward ms/step | rest ms/step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in rows:
        calls = s["calls"] if name == "plugin" else "-"
        lines.append(f"| {name} | {s['tokens_per_s']:.0f} | {s['steps']} | {calls} | {s['wall_ms']:.1f} "
                     f"| {s['forward_ms']:.1f} "
                     f"| {s['rest_ms']:.1f} | {s['forward_ms'] / s['steps']:.2f} | {s['rest_ms'] / s['steps']:.2f} |")
    lines += [
        "",
        f"plugin / plain: {plugin['tokens_per_s'] / plain['tokens_per_s']:.2f}x; the plugin's forwards take "
        f"{plugin['forward_ms'] / plain['forward_ms']:.2f} of the plain loop's time; plugin / plain if the plugin's "
        f"generate were its forwards alone: {plain['wall_ms'] / plugin['forward_ms']:.2f}x",
        "",
        "The plugin's rest, ms per generate: the runner outside the forward (layout, inputs, decoding rule, LM head) "
        f"{plugin['runner_other_ms']:.1f}, between engine calls (vLLM's scheduler and output processing) "
        f"{plugin['between_steps_ms']:.1f}, before the first and after the last step "
        f"{plugin['head_ms'] + plugin['tail_ms']:.1f}.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
