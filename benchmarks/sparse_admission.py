"""Requests admitted concurrently at a fixed KV pool: sparse KV cache vs dual.

    python benchmarks/sparse_admission.py --out benchmarks/results/sparse-admission

Through vLLM itself (offline `LLMEngine`, the plugin's scheduler and worker, CPU):
one engine per block size with a small fixed KV pool (`kv_cache_memory_bytes`, room
for `--dual-fits` dual-cache requests), every request of prompt + canvas = L = 512
tokens in blocks of 32.  For each cache setting (dual; sparse retention 0.5 and 0.3,
set per request through `extra_args`, i.e. `vllm_xargs`) many more requests are
submitted at once than the pool holds, and the engine is stepped until all finish.
A stat logger attached to the engine (vLLM's `StatLoggerBase` interface, fed the
scheduler's `SchedulerStats` after every step) records the peak number of running
requests (`num_running_reqs`, what vLLM exports as vllm:num_requests_running) and
the peak KV usage (`kv_cache_usage`, exported as vllm:kv_cache_usage_perc).

Expected, per the issue: admitted = pool / (ceil(r (L - b)) + b) slots (dual: pool /
L); with whole KV blocks, pool_blocks // ceil(slots / block_size) per request.  The
pool's block count is read from the engine (vLLM sizes it from the byte budget).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import platform
import random
import sys
import time
import typing

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SEQ_LEN = 512  # L: prompt + canvas
BLOCK_LENGTH = 32  # b: the canvas block (a sparse Reuse's queries)
GEN_LENGTH = 128  # four blocks
STEPS = 16  # four steps per block: sparse's delayed update (delay_step 1) has room
SETTINGS = [
    ("dual", {"cache": "dual"}),
    ("sparse r=0.5", {"cache": "sparse", "retention": 0.5}),
    ("sparse r=0.3", {"cache": "sparse", "retention": 0.3}),
]


class PeakLogger:
    """A vLLM stat logger that keeps the peaks of the scheduler's per-step stats."""

    instances: typing.ClassVar[list[PeakLogger]] = []

    def __init__(self, vllm_config, engine_index: int = 0):
        self.reset()
        PeakLogger.instances.append(self)

    def reset(self) -> None:
        self.peak_running = 0
        self.peak_waiting = 0
        self.peak_kv_usage = 0.0
        self.steps = 0
        self.running_trace: list[int] = []

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
        if scheduler_stats is None:
            return
        self.steps += 1
        self.peak_running = max(self.peak_running, scheduler_stats.num_running_reqs)
        self.peak_waiting = max(self.peak_waiting, scheduler_stats.num_waiting_reqs)
        self.peak_kv_usage = max(self.peak_kv_usage, scheduler_stats.kv_cache_usage)
        self.running_trace.append(scheduler_stats.num_running_reqs)

    def log_engine_initialized(self):
        pass

    def log(self):
        pass

    def record_sleep_state(self, is_awake: int, level: int):
        pass


def logger_factory():
    from vllm.v1.metrics.loggers import StatLoggerBase

    # Registered as a StatLoggerBase subclass so vLLM's logger manager accepts it.
    return type("PeakStatLogger", (PeakLogger, StatLoggerBase), {})


def expected(xargs: dict, pool_blocks: int, block_size: int) -> dict:
    """The issue's formula (slots) and its whole-block version (what the scheduler reserves)."""
    span = BLOCK_LENGTH
    if xargs["cache"] == "sparse":
        slots = math.ceil(xargs["retention"] * (SEQ_LEN - span) - 1e-9) + span
    else:
        slots = SEQ_LEN
    blocks = math.ceil(slots / block_size)
    pool_slots = pool_blocks * block_size
    return {
        "slots_per_request": slots,
        "blocks_per_request": blocks,
        "formula_slots": round(pool_slots / slots, 2),  # pool / (ceil(r (L - b)) + b)
        "formula_blocks": pool_blocks // blocks,
    }


def run_engine(model: str, block_size: int, args) -> dict:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    from vllm_dllm.kv_footprint import request_slots
    from vllm_dllm.options import LLaDAOptions

    # Room for `dual_fits` dual-cache requests plus vLLM's null block.
    per_token = 2 * args.layers * args.hidden * 4  # K and V, float32
    pool_bytes = (args.dual_fits * math.ceil(SEQ_LEN / block_size) + 1) * block_size * per_token
    max_fit = args.dual_fits * SEQ_LEN // (math.ceil(0.3 * (SEQ_LEN - BLOCK_LENGTH)) + BLOCK_LENGTH) + 8
    PeakLogger.instances.clear()
    engine_args = EngineArgs(
        model=model, dtype="float32", max_model_len=SEQ_LEN, block_size=block_size,
        max_num_seqs=4 * max_fit, max_num_batched_tokens=SEQ_LEN * max_fit,
        kv_cache_memory_bytes=pool_bytes, enforce_eager=True, gpu_memory_utilization=0.3, seed=0,
        disable_log_stats=False, additional_config={"dllm": {"admission": "greedy"}},
    )
    engine = LLMEngine.from_engine_args(engine_args, stat_loggers=[logger_factory()])
    try:
        num_gpu_blocks = engine.vllm_config.cache_config.num_gpu_blocks
        pool_blocks = num_gpu_blocks - 1  # block 0 is vLLM's null block
        peak = PeakLogger.instances[-1]
        rng = random.Random(0)
        rows = []
        for label, cache in SETTINGS:
            xargs = {**cache, "block_length": BLOCK_LENGTH, "steps": STEPS}
            exp = expected(xargs, pool_blocks, block_size)
            # Cross-check the formula against the plugin's own footprint arithmetic.
            opts = LLaDAOptions(gen_length=GEN_LENGTH, steps=STEPS, block_length=BLOCK_LENGTH,
                                remasking="low_confidence", temperature=0.0, cfg_scale=0.0, logits_eos_inf=False,
                                confidence_eos_eot_inf=False, **cache)
            assert request_slots(opts, SEQ_LEN - GEN_LENGTH) == exp["slots_per_request"], label
            num_requests = args.oversubscribe * exp["formula_blocks"]
            params = SamplingParams(max_tokens=GEN_LENGTH, temperature=0.0, ignore_eos=True, extra_args=xargs)
            peak.reset()
            started = time.time()
            for i in range(num_requests):
                prompt = [rng.randrange(3, 250) for _ in range(SEQ_LEN - GEN_LENGTH)]
                engine.add_request(f"{label}-{i}", {"prompt_token_ids": prompt}, params)
            finished = tokens = 0
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finished += 1
                        tokens += len(out.outputs[0].token_ids)
            wall = time.time() - started
            row = {
                "setting": label, "xargs": xargs, **exp,
                "submitted": num_requests, "finished": finished, "committed_tokens": tokens,
                "peak_running": peak.peak_running,
                "peak_kv_usage": round(peak.peak_kv_usage, 4),
                "peak_kv_blocks": round(peak.peak_kv_usage * pool_blocks, 1),
                "engine_steps": peak.steps,
                "wall_s": round(wall, 1),
            }
            rows.append(row)
            print(json.dumps({"block_size": block_size, **row}), flush=True)
        return {"block_size": block_size, "kv_cache_memory_bytes": pool_bytes, "num_gpu_blocks": num_gpu_blocks,
                "pool_blocks": pool_blocks, "pool_slots": pool_blocks * block_size, "settings": rows}
    finally:
        engine.engine_core.shutdown()


def write_report(result: dict, out: pathlib.Path) -> None:
    lines = [
        "# Requests admitted concurrently at a fixed KV pool: sparse vs dual",
        "",
        f"Measured by `benchmarks/sparse_admission.py` through vLLM {result['vllm']} (offline `LLMEngine`, "
        f"the plugin's greedy admission) on {result['device']}; model: a generated tiny LLaDA checkpoint "
        f"({result['model']}).  Every request: prompt {SEQ_LEN - GEN_LENGTH} + canvas {GEN_LENGTH} = "
        f"L = {SEQ_LEN} tokens, blocks of b = {BLOCK_LENGTH}, {STEPS} steps; all requests of a setting "
        "submitted at once (oversubscribed); peak running = max over engine steps of the scheduler's "
        "`num_running_reqs` (vllm:num_requests_running), peak KV = max of `kv_cache_usage` "
        "(vllm:kv_cache_usage_perc) times the pool's blocks.",
        "",
        "Formula: admitted = pool / (ceil(r (L - b)) + b) slots, dual: pool / L; with whole "
        "KV blocks (what the scheduler reserves): pool_blocks // ceil(slots / block_size).",
        "",
    ]
    for engine in result["engines"]:
        lines += [
            f"## block_size {engine['block_size']}: pool {engine['pool_blocks']} blocks = "
            f"{engine['pool_slots']} slots ({engine['kv_cache_memory_bytes']} bytes)",
            "",
            "| setting | slots / request | blocks / request | formula (slots) | formula (blocks) | "
            "peak running (measured) | = formula (blocks) | x dual | x dual (formula, slots) | peak KV blocks | "
            "peak KV usage | submitted | finished | wall s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        dual = engine["settings"][0]
        for r in engine["settings"]:
            lines.append(
                f"| {r['setting']} | {r['slots_per_request']} | {r['blocks_per_request']} | {r['formula_slots']} | "
                f"{r['formula_blocks']} | {r['peak_running']} | {'yes' if r['peak_running'] == r['formula_blocks'] else 'NO'} | "
                f"{r['peak_running'] / dual['peak_running']:.2f} | {r['formula_slots'] / dual['formula_slots']:.2f} | "
                f"{r['peak_kv_blocks']} | {r['peak_kv_usage']:.1%} | {r['submitted']} | {r['finished']} | "
                f"{r['wall_s']} |"
            )
        lines.append("")
    lines += [
        "Every request of every setting finished (all its canvas tokens committed).  The block size "
        "rounds each request's slots up to whole blocks: at 16 (the GPU default) the measured ratios are "
        "within a block of the slot formula; at 128 (the plugin's CPU default) a sparse request's "
        "176 or 272 slots take 2 or 3 of the 4 blocks a dual one takes (default settings), so the gain shrinks to 2.0x / 1.31x there.",
        "",
        f"Command: `{result['command']}` ({result['wall_s']} s for both engines, start-up included).",
        "",
    ]
    (out / "results.md").write_text("\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "benchmarks" / "results" / "sparse-admission")
    ap.add_argument("--block-sizes", default="16,128", help="KV block sizes (128 is the plugin's CPU default)")
    ap.add_argument("--dual-fits", type=int, default=16, help="pool size, in dual-cache requests")
    ap.add_argument("--oversubscribe", type=int, default=2, help="requests submitted per expected admission")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

    import vllm

    from vllm_dllm.tools.make_tiny import make_tiny

    args.out.mkdir(parents=True, exist_ok=True)
    model = str(make_tiny("llada", args.out / "model", seed=0, hidden=args.hidden, layers=args.layers,
                          heads=args.hidden // 64, intermediate=args.hidden * 2, max_len=SEQ_LEN))
    started = time.time()
    engines = [run_engine(model, int(bs), args) for bs in args.block_sizes.split(",")]
    result = {
        "vllm": vllm.__version__,
        "device": f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        "model": f"make_tiny llada hidden {args.hidden}, {args.layers} layers, float32",
        "seq_len": SEQ_LEN, "block_length": BLOCK_LENGTH, "gen_length": GEN_LENGTH, "steps": STEPS,
        "command": "python benchmarks/sparse_admission.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "wall_s": round(time.time() - started, 1),
        "engines": engines,
    }
    (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    write_report(result, args.out)
    print((args.out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
