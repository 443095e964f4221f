"""Tensor parallelism on the CPU: TP=2 against TP=1.

    python benchmarks/tensor_parallel.py --out benchmarks/results/tensor-parallel

The shipped task model has 3 attention heads, which two ranks cannot split (vLLM
refuses at start-up), so the model is a generated LLaDA-format one of the shipped
model's proportions with 4 heads (hidden 256, 4 layers; random weights: the work, not
the answers, is what is compared).  Each setting runs in a fresh process (vLLM reads
its environment at start), in alternation over --rounds: offline
`vllm.LLM(...).generate` of --num-requests random prompts of 48 tokens at once, a 32-token canvas, block 8,
32 steps, dual cache, greedy, ignore_eos; one warm-up generate, then --repeats
measured ones, median by wall time.  Reported: committed tokens/s, and whether TP=2
returned exactly TP=1's tokens.  TP=2 binds one core to each rank
(VLLM_CPU_OMP_THREADS_BIND), TP=1 gets both cores: on a 2-core machine this checks
correctness, not speed (two ranks of one core each, an all-reduce per layer, against
one rank with both cores).

`--executor ray` runs TP=2 under Ray (`pip install vllm-dllm[ray]`) instead of vLLM's
multiprocessing executor, with the same equality check against TP=1.  vLLM's CPU
platform refuses Ray at engine start ("current platform cpu does not support ray"):
on CPU the run records that refusal (results-ray.json) instead of figures; on a
machine with two GPUs it is the Ray check.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import re
import statistics
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
CANVAS = 32


def child(args: argparse.Namespace) -> dict:
    import random

    from vllm import LLM, SamplingParams

    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 250) for _ in range(48)]} for _ in range(args.num_requests)]
    executor = {"distributed_executor_backend": "ray"} if args.tp > 1 and args.executor == "ray" else {}
    llm = LLM(model=args.model, dtype="float32", max_model_len=512, max_num_seqs=args.num_requests,
              max_num_batched_tokens=8192, enforce_eager=True, tensor_parallel_size=args.tp, seed=0,
              kv_cache_memory_bytes=256 << 20, gpu_memory_utilization=0.3, **executor)
    params = SamplingParams(max_tokens=CANVAS, temperature=0.0, ignore_eos=True,
                            extra_args={"steps": CANVAS, "block_length": 8, "cache": "dual"})
    runs = []
    tokens = None
    for _ in range(1 + args.repeats):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        runs.append({"wall_s": wall, "tokens_per_s": sum(map(len, tokens)) / wall})
    measured = sorted(runs[1:], key=lambda r: r["wall_s"])[len(runs[1:]) // 2]
    return {"tp": args.tp, **measured, "tokens": tokens}


def run_setting(tp: int, args: argparse.Namespace) -> dict:
    env = dict(os.environ)
    if tp > 1:
        cpus = sorted(os.sched_getaffinity(0))
        share = len(cpus) // tp
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
            ",".join(map(str, cpus[r * share:(r + 1) * share])) for r in range(tp))
    cmd = [sys.executable, __file__, "--child", "--tp", str(tp), "--num-requests", str(args.num_requests),
           "--repeats", str(args.repeats), "--model", args.model, "--executor", args.executor]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError(f"TP={tp} failed:\n{proc.stderr[-20000:]}")
    return json.loads(lines[-1])


def ray_refusal(args: argparse.Namespace) -> dict | None:
    """Why TP=2 under Ray does not start on this machine, from trying it (None: it runs)."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        return {"executor": "ray", "ran": False, "reason": "ray is not installed (pip install vllm-dllm[ray])"}
    try:
        run_setting(2, args)
    except RuntimeError as error:
        # The root cause, not the engine's "initialization failed" that follows it.
        causes = [line.split("] ")[-1].strip() for line in str(error).splitlines()
                  if re.search(r"\w+Error: ", line) and "initialization failed" not in line]
        return {"executor": "ray", "ran": False, "reason": causes[-1] if causes else str(error)[-500:],
                "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} usable CPUs"}
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, default=HERE / "results" / "tensor-parallel")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--executor", choices=["mp", "ray"], default="mp",
                    help="TP=2's executor: vLLM's multiprocessing one, or Ray")
    ap.add_argument("--model", default=None, help="checkpoint (default: generated under --out/model)")
    args = ap.parse_args()
    if args.model is None and not args.child:
        from vllm_dllm.tools.make_tiny import make_tiny

        args.model = str(make_tiny("llada", args.out / "model", seed=0, hidden=256, layers=4, heads=4,
                                   intermediate=768, max_len=512))
    if args.child:
        print(json.dumps(child(args)))
        return
    if args.executor == "ray":
        refusal = ray_refusal(args)
        if refusal is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "results-ray.json").write_text(json.dumps(refusal, indent=2) + "\n")
            print(f"Ray refused here: {refusal['reason']}")
            return
    rows: dict[int, list[dict]] = {1: [], 2: []}
    for _ in range(args.rounds):
        for tp in (1, 2):
            rows[tp].append(run_setting(tp, args))
            print(f"TP={tp}: {rows[tp][-1]['tokens_per_s']:.1f} tokens/s", flush=True)
    same = all(r["tokens"] == rows[1][0]["tokens"] for tp in (1, 2) for r in rows[tp])
    summary = {
        "machine": f"{platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} usable CPUs",
        "num_requests": args.num_requests, "canvas": CANVAS, "repeats": args.repeats, "rounds": args.rounds,
        "tokens_per_s": {tp: statistics.median(r["tokens_per_s"] for r in rows[tp]) for tp in rows},
        "same_tokens": same,
        "runs": {tp: [{k: v for k, v in r.items() if k != "tokens"} for r in rows[tp]] for tp in rows},
    }
    summary["tp2_over_tp1"] = round(summary["tokens_per_s"][2] / summary["tokens_per_s"][1], 3)
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.executor == "mp" else f"-{args.executor}"
    (args.out / f"results{suffix}.json").write_text(json.dumps(summary, indent=2) + "\n")
    table = (f"Machine: {summary['machine']}; generated LLaDA-format model (hidden 256, 4 layers, 4 heads); "
             f"{args.num_requests} prompts of 48 tokens at once, canvas {CANVAS}, "
             f"block 8, dual cache, greedy; median of {args.rounds} processes x {args.repeats} generates.\n\n"
             "| setting | committed tokens/s | vs TP=1 | same tokens as TP=1 |\n|---|---|---|---|\n"
             f"| TP=1 (both cores) | {summary['tokens_per_s'][1]:.1f} | 1.00 | - |\n"
             f"| TP=2 ({'a core per rank' if args.executor == 'mp' else 'Ray'}) | "
             f"{summary['tokens_per_s'][2]:.1f} | {summary['tp2_over_tp1']:.2f} | "
             f"{'yes' if same else 'NO'} |\n")
    (args.out / f"table{suffix}.md").write_text(table)
    print(table)
    if not same:
        raise SystemExit("TP=2 tokens differ from TP=1")


if __name__ == "__main__":
    main()
