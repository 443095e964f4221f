"""Where a step's time goes: torch.profiler over our engine's step and the ideal step.

    python benchmarks/profile_step.py --out /tmp/profile            # LLaDA-8B shape, bf16
    python benchmarks/profile_step.py --small --out /tmp/profile    # small shape, fp32

(on CUDA where there is one, else the CPU)

Companion to step_bench.py (same model, engine set-up and ideal step; no vLLM).  For
each case it profiles a few steps of ours and of the ideal and writes, per side, the
operator table sorted by device time and by host time, and a summary line: wall ms per
step (with the profiler on, which adds host time), device-busy ms per step, kernels
launched per step.  A step whose wall time is far above its device time is bound by
the host (launches, Python); one whose device time is above the ideal's does more or
slower GPU work.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import step_bench as sb  # noqa: E402

from vllm_dllm.engine.torch_model import LLADA_8B, build_model  # noqa: E402


def ours_stepper(model, requests, context, device, cuda_graphs):
    engine = sb.make_engine(model, requests, context, device, cuda_graphs=cuda_graphs)
    ids = sb.add(engine, requests, context, 4 * sb.BLOCK, "dual")
    engine.step(ids)  # the Refresh; the profiled steps are Reuse steps of the same block
    return lambda: engine.step(ids)


def ideal_stepper(model, requests, context, device, cuda_graphs):
    ideal = sb.IdealStep(model, requests, context, device)
    ideal.step(0, context, True)
    if not cuda_graphs:
        return lambda: ideal.step(context - sb.BLOCK, sb.BLOCK, False)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            ideal.step(context - sb.BLOCK, sb.BLOCK, False)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ideal.step(context - sb.BLOCK, sb.BLOCK, False)
    return graph.replay


def profile_side(step, device, steps: int) -> tuple[dict, str, str]:
    for _ in range(3):
        step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        wall = (time.perf_counter() - start) * 1e3 / steps
    events = prof.key_averages()
    # Device events only: an op's own row repeats the time of the kernels it launched.
    kernel_events = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    device_us = sum(e.self_device_time_total for e in kernel_events)
    kernels = sum(e.count for e in kernel_events)
    summary = {"wall_ms_per_step": round(wall, 3), "device_ms_per_step": round(device_us / 1e3 / steps, 3),
               "kernels_per_step": kernels / steps}
    by_device = events.table(sort_by="self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total",
                             row_limit=30)
    by_host = events.table(sort_by="cpu_time_total", row_limit=30)
    return summary, by_device, by_host


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--steps", type=int, default=5, help="profiled steps, at most 28 (all Reuse steps of one block)")
    parser.add_argument("--cases", default="1x512g,1x512,4x2048,16x512",
                        help="requests x context, suffix g: with CUDA graphs")
    args = parser.parse_args()
    if not 1 <= args.steps <= 28:
        parser.error("--steps: 1 to 28 (the block has 32 steps: its Refresh, 3 warm-up steps, then these)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_grad_enabled(False)
    shape, dtype = (sb.SMALL, torch.float32) if args.small else (LLADA_8B, torch.bfloat16)
    model = build_model(shape, dtype, device)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for case in args.cases.split(","):
        graphs = case.endswith("g")
        if graphs and device.type != "cuda":
            continue
        requests, context = (int(v) for v in case.rstrip("g").split("x"))
        row = {"case": case, "requests": requests, "context": context, "cuda_graphs": graphs}
        for side, make in (("ours", ours_stepper), ("ideal", ideal_stepper)):
            summary, by_device, by_host = profile_side(make(model, requests, context, device, graphs), device,
                                                       args.steps)
            sb.release(model)
            row[side] = summary
            (args.out / f"{case}-{side}-by-device.txt").write_text(by_device)
            (args.out / f"{case}-{side}-by-host.txt").write_text(by_host)
        results.append(row)
        print(json.dumps(row), flush=True)
        (args.out / "summary.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
