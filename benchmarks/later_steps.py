"""What whole-step CUDA graphs save in a call's later steps (engine/step_graphs.py).

    python benchmarks/later_steps.py --out benchmarks/results/step-gpu/later-steps  # CUDA, bf16, 8B shape
    python benchmarks/later_steps.py --smoke --out /tmp/later-smoke                 # toy sizes, checks the script

Imports no vLLM (a bare GPU machine runs it: benchmarks/gpu_session.sh bench).  On an
LLaDA-8B-shaped plain-torch model with CUDA graphs on, the steps of a block after its
first, for 1 and 4 LLaDA and LLaDA2 requests, three ways: in one engine call with the
later steps replayed from whole-step graphs; in one call with Reuse graphs alone (the
rule eager); one step a call.  The ways alternate, twice each, a block a repetition;
reported: median ms per step of each, and the ratios.  On a CPU (--smoke only) there
are no graphs: the ways differ only in calls.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from step_bench import (  # noqa: E402
    BLOCK, BLOCK_SIZE, LLADA_8B, TOY, Timer, build_model, llada2_options, make_engine, options, release,
)

PROMPT = 256
MODES = ("step_graphs", "reuse_graphs", "one_step_calls")


def later_steps(model, kind: str, requests: int, timer: Timer, reps: int, device, mode: str) -> float:
    """ms per step of a block's steps after its first, `mode` one of MODES."""
    gen = BLOCK * (reps + 3)
    context = gen + PROMPT
    engine = make_engine(model, requests, context, device, cuda_graphs=True, kind=kind,
                         step_graphs=mode == "step_graphs")
    blocks = -(-context // BLOCK_SIZE)
    ids = []
    for i in range(requests):
        opts = llada2_options(gen) if kind == "llada2" else options(gen, "dual")
        engine.add(f"r{i}", [(17 * i + j) % 1000 + 10 for j in range(PROMPT)], opts, seed=i,
                   block_ids=list(range(1 + i * blocks, 1 + (i + 1) * blocks)))
        ids.append(f"r{i}")
    times = []
    for rep in range(reps + 2):  # two blocks of warm-up: the captures
        engine.step(ids)  # the block's first step (a Refresh)
        timer.sync()
        start = time.perf_counter()
        if mode == "one_step_calls":
            ran = sum(engine.step(ids).steps for _ in range(BLOCK - 1))
        else:
            ran = engine.step(ids, steps=BLOCK - 1).steps
        timer.sync()
        if rep >= 2:
            times.append((time.perf_counter() - start) * 1e3 / ran)
    release(model)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="toy sizes, one repetition: measures nothing")
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--reps", type=int, default=None, help="blocks a measurement (default 5; --smoke 1)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape, dtype = (TOY, torch.float32 if device.type == "cpu" else torch.bfloat16) if args.smoke else (
        LLADA_8B, torch.bfloat16)
    reps = args.reps or (1 if args.smoke else 5)
    torch.set_grad_enabled(False)
    model = build_model(shape, dtype, device)
    timer = Timer(device)
    rows = []
    for kind in ("llada", "llada2"):
        for requests in (1, 4):
            runs = {mode: [] for mode in MODES}
            for _ in range(2):
                for mode in MODES:
                    runs[mode].append(later_steps(model, kind, requests, timer, reps, device, mode))
            ms = {mode: round(statistics.median(runs[mode]), 3) for mode in MODES}
            rows.append({"kind": kind, "requests": requests, **{f"{mode}_ms": ms[mode] for mode in MODES},
                         "ratio": round(ms["step_graphs"] / ms["reuse_graphs"], 3),
                         "ratio_to_one_step_calls": round(ms["step_graphs"] / ms["one_step_calls"], 3)})
            print(f"{kind} x {requests}, ms/step: whole-step graphs {ms['step_graphs']:.3f}, "
                  f"Reuse graphs alone {ms['reuse_graphs']:.3f}, one step a call {ms['one_step_calls']:.3f}",
                  flush=True)
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(
        {"device": device_name, "torch": torch.__version__, "reps": reps, "later_steps": rows}, indent=2) + "\n")
    lines = [f"Device: {device_name}, torch {torch.__version__}; ms per step of a block's steps after its first", "",
             "| rule | requests | whole-step graphs | Reuse graphs alone | one step a call | ratio to Reuse graphs "
             "alone | ratio to one step a call |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['kind']} | {r['requests']} | {r['step_graphs_ms']} | {r['reuse_graphs_ms']} "
              f"| {r['one_step_calls_ms']} | {r['ratio']} | {r['ratio_to_one_step_calls']} |" for r in rows]
    (args.out / "table.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
