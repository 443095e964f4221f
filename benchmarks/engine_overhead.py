"""CPU engine overhead of one diffusion step on the shipped task model.

    PYTHONPATH=/path/to/tree python benchmarks/engine_overhead.py --label baseline \
        --out benchmarks/results/engine-overhead/baseline \
        [--settings default,all-cores,nobind,inproc,inproc-1t] [--rounds 2] [--repeats 3]

Workload: offline `vllm.LLM(...).generate` of 32 requests submitted at once on the
shipped task model, with task prompts (the held-out split of lab.tasks, an
equal mix of the four tasks, chat template applied, passed as token ids), a 32-token
canvas, block 8, 32 steps, dual cache, ignore_eos.  `max_num_seqs` and
`max_num_batched_tokens` are set so every request can run every engine step (a
Refresh costs prompt + canvas query tokens per request; 8192 by default, raised to
the all-Refresh step if that is larger); the batch size of every step is recorded.

The tree measured is whichever `vllm_dllm` Python imports (PYTHONPATH first): the
script only uses vLLM's public surface, `vllm_dllm.default_model.PATH` and
`lab.tasks`, and records `vllm_dllm.__file__` as the worker process sees it.

Timers live in the worker process, through vLLM's `worker_extension_cls` (the mixin
in worker_timing.py; no vLLM or plugin code is changed), so the default multiprocess
engine (front end, engine core, worker) is measured as shipped.  They wrap, on the
instances, the runner's `execute_model`, the model's `forward` (the runner's
`self.model(...)`) and its `compute_logits`.  Per engine step (one `execute_model`
call that scheduled tokens):

  ms_per_step          wall time of generate / engine steps (everything: front end,
                       scheduler, IPC, runner)
  runner_ms_per_step   inside the runner's execute_model
  forward_ms_per_step  model forward;  logits_ms_per_step: LM head (compute_logits)
  overhead_fraction    1 - (forward + logits) / wall

and where the wall time went: head (generate called -> first step starts), forward,
logits, runner other, between steps (scheduler, IPC, output processing), tail; the
worker's clock (time.perf_counter = CLOCK_MONOTONIC) is the front end's.  CPU time of
each process and of everything else on the machine during the generate is recorded
too, since the machine is shared.

With --profile-ops N, each process runs one more generate with torch.profiler on in the
worker and reports its N costliest torch ops per engine step (self CPU time, calls); the
profiled generate is not among the timed ones.

Each CPU thread setting (SETTINGS) runs in a fresh process, since vLLM reads its
environment at start; --rounds goes through the settings several times, interleaved,
so a burst of outside load does not land on one setting only.  Each process does one
warm-up generate, then --repeats measured ones; a setting's row is its median
measured generate (by wall time) over all its processes.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from engine_overhead_report import table
from worker_timing import cpus_allowed, machine_busy_seconds

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # lab/ sits at the repository root

HERE = pathlib.Path(__file__).resolve().parent

# CPU thread settings.  With the default multiprocessing engine vLLM's
# MultiprocExecutor sets OMP_NUM_THREADS / GOMP_CPU_AFFINITY (or OMP_PLACES) for the
# worker process from VLLM_CPU_OMP_THREADS_BIND (default "auto": one logical CPU
# per physical core of the rank's NUMA node, minus VLLM_CPU_NUM_OF_RESERVED_CPU,
# default 1 per local rank on x86/ARM, kept for the engine-core process).  On a
# 2-core machine that leaves the worker one OpenMP thread on core 0.
SETTINGS = {
    # whatever the environment and the plugin give (the plugin sets
    # VLLM_CPU_NUM_OF_RESERVED_CPU=0 and GOMP_SPINCOUNT=10000 on machines of at most
    # 2 usable CPUs).
    "default": {},
    # the plugin's default with libgomp's own spin (what the default was before).
    "libgomp-spin": {"GOMP_SPINCOUNT": "300000"},
    # vLLM's own default: one core kept for the engine core.
    "vllm-default": {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"},
    # auto binding without the reserved core: the worker's OpenMP threads on every
    # core of the node (same as VLLM_CPU_OMP_THREADS_BIND=0-<n-1> here).
    "all-cores": {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
    # the worker's one OpenMP thread on core 0, no core kept for the engine core: the
    # worker a thread short, as if yielding a core to a neighbour (the engine core's
    # shm-queue spin takes that core, threads-and-neighbour/summary.md).
    "one-thread": {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_OMP_THREADS_BIND": "0"},
    # no binding: OMP_* left alone, torch's default thread count, no pinning.
    "nobind": {"VLLM_CPU_OMP_THREADS_BIND": "nobind"},
    # engine core and worker in this process (UniProcExecutor): vLLM applies no
    # thread binding at all on this path.
    "inproc": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    # the same with one torch thread (what the default gives the worker).
    "inproc-1t": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"},
    # The OpenMP runtime torch uses here (GNU libgomp): threads that finish a
    # parallel region spin for GOMP_SPINCOUNT iterations (default 300,000) before
    # sleeping; they compete with the engine-core process between steps, and with
    # any other process for a core.  PASSIVE: sleep at once; a short spin between.
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "spin-10k": {"GOMP_SPINCOUNT": "10000"},
    "spin-30k": {"GOMP_SPINCOUNT": "30000"},
    "spin-100k": {"GOMP_SPINCOUNT": "100000"},
}

NUM_REQUESTS = 32
CANVAS = 32
XARGS = {"steps": 32, "block_length": 8, "cache": "dual"}


def summarize(wall_start: float, wall_end: float, tokens: int, stats: dict, num_requests: int,
              canvas: int) -> dict:
    """One measured generate: per-step means and where the wall time went."""
    steps = stats["steps"]
    n = len(steps)
    wall = wall_end - wall_start
    forward = sum(s["forward_s"] for s in steps)
    logits = sum(s["logits_s"] for s in steps)
    execute = sum(s["end"] - s["start"] for s in steps)
    gaps = sum(b["start"] - a["end"] for a, b in zip(steps, steps[1:]))
    head = steps[0]["start"] - wall_start if steps else None
    tail = wall_end - steps[-1]["end"] if steps else None
    per = lambda seconds: 1e3 * seconds / n if n else None  # noqa: E731
    # A step that Refreshes any request packs whole sequences: more query tokens
    # than every request's canvas together (Reuse steps of the dual cache pack
    # the active block only).
    refresh = [s for s in steps if s["tokens"] > num_requests * canvas]
    reuse = [s for s in steps if s["tokens"] <= num_requests * canvas]

    def kind(group):
        if not group:
            return None
        return {
            "steps": len(group),
            "mean_tokens": sum(s["tokens"] for s in group) / len(group),
            "runner_ms": 1e3 * sum(s["end"] - s["start"] for s in group) / len(group),
            "forward_ms": 1e3 * sum(s["forward_s"] for s in group) / len(group),
            "logits_ms": 1e3 * sum(s["logits_s"] for s in group) / len(group),
        }

    return {
        "wall_s": wall,
        "committed_tokens": tokens,
        "steps": n,  # engine calls
        "forwards": sum(s["forward_calls"] for s in steps),  # denoising steps (and prefill chunks)
        "empty_steps": stats["empty_steps"],
        "batch_size_min": min((s["batch"] for s in steps), default=0),
        "batch_size_max": max((s["batch"] for s in steps), default=0),
        "denoising_steps": sum(s["batch"] * s["forward_calls"] for s in steps),
        "ms_per_step": per(wall),
        "runner_ms_per_step": per(execute),
        "forward_ms_per_step": per(forward),
        "logits_ms_per_step": per(logits),
        "overhead_fraction": 1 - (forward + logits) / wall,
        "runner_overhead_fraction": 1 - (forward + logits) / execute if execute else None,
        "committed_tokens_per_s": tokens / wall,
        # wall = head + sum(runner) + sum(gaps) + tail
        "breakdown_ms": {
            "head": 1e3 * head if head is not None else None,  # generate() called -> first step starts
            "forward": 1e3 * forward,
            "logits": 1e3 * logits,
            "runner_other": 1e3 * (execute - forward - logits),  # in execute_model, not model
            "between_steps": 1e3 * gaps,  # scheduler, IPC, output processing
            "tail": 1e3 * tail if tail is not None else None,  # last step ends -> generate returns
        },
        "refresh_steps": kind(refresh),
        "reuse_steps": kind(reuse),
        "forward_calls": sum(s["forward_calls"] for s in steps),
        "logits_calls": sum(s["logits_calls"] for s in steps),
        "logits_rows": sum(s["logits_rows"] for s in steps),
        "worker_cpu_s": stats["worker_cpu_s"],
        "engine_core_cpu_s": stats["parent_cpu_s"],
        "batch_sizes": [s["batch"] for s in steps],
        "batch_tokens": [s["tokens"] for s in steps],
        "worker_thread_affinities": stats["worker_thread_affinities"],
    }


# ---- one setting, in a fresh process ------------------------------------------


def _git(tree: pathlib.Path, *args: str) -> str:
    try:
        return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception:  # noqa: BLE001 - provenance only
        return "?"


def build_prompts(tokenizer, n: int, seed: int) -> tuple[list[list[int]], list[str]]:
    import random

    from lab.tasks import TASKS, TEST

    rng = random.Random(seed)
    names = sorted(TASKS)
    prompts, tasks = [], []
    for i in range(n):
        name = names[i % len(names)]
        text = TASKS[name].sample(rng, TEST).prompt
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        # The template already holds the special tokens (LLaDA's convention).
        prompts.append(list(tokenizer.encode(chat, add_special_tokens=False)))
        tasks.append(name)
    return prompts, tasks


def run_child(args: argparse.Namespace) -> dict:
    import vllm_dllm
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm_dllm.default_model import PATH

    tree = pathlib.Path(vllm_dllm.__file__).resolve().parent.parent
    model = args.model or str(PATH)
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts, tasks = build_prompts(tokenizer, args.num_requests, args.seed)
    refresh_tokens = sum(len(p) + CANVAS for p in prompts)  # every request refreshing at once
    max_batched = max(args.max_num_batched_tokens, refresh_tokens)
    llm = LLM(
        model=model,
        dtype=args.dtype,
        max_model_len=512,
        max_num_seqs=max(args.num_requests, 32),
        max_num_batched_tokens=max_batched,
        kv_cache_memory_bytes=256 << 20,
        gpu_memory_utilization=0.3,
        enforce_eager=True,
        seed=0,
        worker_extension_cls="worker_timing.TimingExtension",
    )
    info = llm.collective_rpc("dllm_bench_install")[0]
    params = SamplingParams(max_tokens=CANVAS, temperature=0.0, ignore_eos=True, extra_args=dict(XARGS))
    inputs = [{"prompt_token_ids": p} for p in prompts]

    def once() -> dict:
        llm.collective_rpc("dllm_bench_reset")
        busy0 = machine_busy_seconds()
        cpu0 = time.process_time()
        start = time.perf_counter()
        outs = llm.generate(inputs, params, use_tqdm=False)
        end = time.perf_counter()
        frontend_cpu = time.process_time() - cpu0
        busy1 = machine_busy_seconds()
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        stats = llm.collective_rpc("dllm_bench_stats")[0]
        run = summarize(start, end, tokens, stats, len(prompts), CANVAS)
        if info["pid"] == os.getpid():  # in-process engine: the worker's parent is the driver
            run["engine_core_cpu_s"] = None
        run["frontend_cpu_s"] = frontend_cpu
        # CPU time of everything else on the machine during the generate: the noise.
        ours = frontend_cpu + (run["worker_cpu_s"] or 0.0) + (run["engine_core_cpu_s"] or 0.0)
        if info["pid"] == os.getpid():
            ours = frontend_cpu  # one process: the front end's CPU time is everything
        run["machine_busy_s"] = busy1 - busy0 if busy0 is not None and busy1 is not None else None
        run["other_processes_cpu_s"] = run["machine_busy_s"] - ours if run["machine_busy_s"] is not None else None
        return run

    warmup = once()
    runs = [once() for _ in range(args.repeats)]
    op_profile = None
    if args.profile_ops:
        llm.collective_rpc("dllm_bench_profile_start")
        profiled = once()
        ops = llm.collective_rpc("dllm_bench_profile_stop", args=(args.profile_ops,))[0]
        op_profile = {"steps": profiled["steps"], "wall_s": profiled["wall_s"], "ops": ops}
    return {
        "setting": args.child,
        "env": SETTINGS[args.child],
        "tree": {"path": str(tree), "head": _git(tree, "rev-parse", "HEAD"),
                 "dirty": bool(_git(tree, "status", "--porcelain", "--untracked-files=no"))},
        "frontend": {"pid": os.getpid(), "cpus_allowed": cpus_allowed(),
                     "vllm_dllm_file": vllm_dllm.__file__},
        "worker": info,
        "worker_thread_affinities": runs[-1]["worker_thread_affinities"],
        "workload": {"num_requests": len(prompts), "tasks": {t: tasks.count(t) for t in sorted(set(tasks))},
                     "prompt_tokens": [len(p) for p in prompts], "canvas": CANVAS, "xargs": XARGS,
                     "ignore_eos": True, "dtype": args.dtype, "refresh_tokens_all": refresh_tokens,
                     "max_num_batched_tokens": max_batched, "max_num_seqs": max(args.num_requests, 32)},
        "warmup_wall_s": [warmup["wall_s"]],
        "repeats": runs,
        "op_profile": op_profile,
    }


def merge(parts: list[dict]) -> dict:
    """One setting's processes (rounds) -> one result: the median measured generate
    (by wall time) over all of them, plus every generate's wall time."""
    result = dict(parts[0])
    runs = [run for part in parts for run in part["repeats"]]
    result["repeats"] = runs
    result["warmup_wall_s"] = [w for part in parts for w in part["warmup_wall_s"]]
    result["rounds"] = len(parts)
    median = sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2]
    result.update({k: v for k, v in median.items()
                   if k not in ("worker_thread_affinities", "batch_sizes", "batch_tokens")})
    result["wall_s_all"] = [r["wall_s"] for r in runs]
    result["wall_s_min"] = min(result["wall_s_all"])
    result["ms_per_step_min"] = min(r["ms_per_step"] for r in runs)
    result["steps_all"] = [r["steps"] for r in runs]
    return result


# ---- driver --------------------------------------------------------------------


def run_setting(args: argparse.Namespace, name: str, round_: int, failures: dict) -> dict | None:
    """One setting in a fresh process; its result, or None (recorded in failures)."""
    env = dict(os.environ)
    env.update(SETTINGS[name])
    # The worker imports its timers from this directory (worker_timing.py); the
    # tree under test stays first on the path.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), str(HERE)) if p)
    tag = f"{name}.{round_}" if args.rounds > 1 else name
    with tempfile.TemporaryDirectory() as tmp:
        child_out = pathlib.Path(tmp) / "result.json"
        cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--child", name,
               "--child-out", str(child_out), "--repeats", str(args.repeats),
               "--num-requests", str(args.num_requests), "--seed", str(args.seed),
               "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--dtype", args.dtype,
               "--profile-ops", str(args.profile_ops)]
        if args.model:
            cmd += ["--model", args.model]
        print(f"[{tag}] {' '.join(f'{k}={v}' for k, v in SETTINGS[name].items())} {' '.join(cmd)}",
              file=sys.stderr, flush=True)
        # A busy neighbour: an unrelated process computing on one core for the
        # whole run (unpinned, as a monitoring agent or a second service would be).
        neighbour = (subprocess.Popen([sys.executable, "-c", "while True: pass"])
                     if args.busy_neighbour else None)
        try:
            proc = subprocess.run(cmd, env=env, timeout=args.timeout, capture_output=True, text=True)
        except subprocess.TimeoutExpired:
            failures[tag] = f"timed out after {args.timeout}s"
            return None
        finally:
            if neighbour is not None:
                neighbour.kill()
                neighbour.wait()
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"{tag}.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0 or not child_out.exists():
            failures[tag] = f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-2000:]}"
            print(failures[tag], file=sys.stderr)
            return None
        result = json.loads(child_out.read_text())
    for r in result["repeats"]:
        print(f"[{tag}] steps={r['steps']} batch={r['batch_size_min']}-{r['batch_size_max']} "
              f"wall={r['wall_s']:.3f}s ms/step={r['ms_per_step']:.2f} overhead={r['overhead_fraction']:.1%} "
              f"other-cpu={r['other_processes_cpu_s']:.2f}s", file=sys.stderr, flush=True)
    print(f"[{tag}] vllm_dllm in the worker: {result['worker']['vllm_dllm_file']}", file=sys.stderr)
    if any(r["forward_calls"] == 0 or r["logits_calls"] == 0 for r in result["repeats"]):
        print(f"[{tag}] WARNING: the model's forward or compute_logits was never called through the "
              "instance the timers wrap (runner.get_model()); forward/logits times are 0", file=sys.stderr)
    n = result["workload"]["num_requests"]
    if any(r["batch_size_max"] != n for r in result["repeats"]):
        print(f"[{tag}] WARNING: no step ran all {n} requests together", file=sys.stderr)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", default="run")
    parser.add_argument("--out", type=pathlib.Path)
    parser.add_argument("--settings", default="default,all-cores",
                        help=f"comma-separated, from {', '.join(SETTINGS)}")
    parser.add_argument("--repeats", type=int, default=3, help="measured generates per process")
    parser.add_argument("--rounds", type=int, default=1,
                        help="go through the settings this many times (fresh processes, interleaved)")
    parser.add_argument("--num-requests", type=int, default=NUM_REQUESTS)
    parser.add_argument("--busy-neighbour", action="store_true",
                        help="run each setting beside an unrelated process spinning on one core")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192,
                        help="raised to the all-Refresh step's tokens if that is larger")
    parser.add_argument("--seed", type=int, default=0, help="task instance sampling")
    parser.add_argument("--model", default=None, help="default: the shipped task model")
    parser.add_argument("--dtype", default="float32",
                        help="model dtype (vLLM's --dtype); 'auto' is the checkpoint's (bfloat16 for the shipped model)")
    parser.add_argument("--profile-ops", type=int, default=0, metavar="N",
                        help="after the measured generates, one more under torch.profiler in the worker; "
                             "the table lists its N costliest ops per engine step (not in the timings)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per setting")
    parser.add_argument("--child", choices=sorted(SETTINGS), help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=pathlib.Path, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        result = run_child(args)
        args.child_out.write_text(json.dumps(result, indent=1))
        return

    settings = [s for s in args.settings.split(",") if s]
    for name in settings:
        if name not in SETTINGS:
            parser.error(f"unknown setting {name!r}; choose from {', '.join(SETTINGS)}")
    parts: dict[str, list[dict]] = {name: [] for name in settings}
    failures: dict[str, str] = {}
    for round_ in range(args.rounds):
        for name in settings:
            result = run_setting(args, name, round_, failures)
            if result is not None:
                parts[name].append(result)
    results = [merge(parts[name]) for name in settings if parts[name]]
    text = table(args.label, results)
    for name, why in failures.items():
        text += f"\n\n{name}: FAILED ({why.splitlines()[-1] if why else ''})"
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        payload = {"label": args.label, "argv": sys.argv, "python": sys.executable,
                   "results": results, "failures": failures}
        (args.out / "results.json").write_text(json.dumps(payload, indent=1))
        (args.out / "table.md").write_text(text + "\n")
    if failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
