"""Serving benchmark: four scheduling configurations, driven by `vllm bench serve`.

    python benchmarks/serve_sweep.py --out benchmarks/results/scheduling \
        --workloads burst,osc,livebench --rates 1,2,4 --num-prompts 32

For each configuration the harness starts `vllm serve` on a loopback port, runs
`vllm bench serve` (a client we did not write) for every workload and request rate,
scrapes the plugin's /metrics around each run, and writes results.json, table.md
and PNG plots (throughput and latency against request rate).  Ratios are against
configuration (b), measured in the same invocation.

Configurations (server-wide `--additional-config '{"dllm": ...}'`):
  a  exact decoding (no KV reuse), static batches: a new batch starts when the last ends
  b  dual cache, request-level scheduling: every request is provisioned for its
     Refresh cost for as long as it runs
  c  dual cache, phase-multiplexed greedy admission (Reuse steps free headroom)
  d  (c) with lookahead admission: future Refresh peaks never exceed the budget
  e  (c) with parallel decoding: Fast-dLLM's confidence threshold 0.9
  s5 (c) with the sparse KV cache, retention 0.5 (each KV head keeps half the
     context; a request reserves KV for kept + block slots, not its whole sequence)
  s3 (c) with the sparse KV cache, retention 0.3

LLaDA2 configurations (`--arch llada2`: a generated LLaDA2-format MoE model; block
diffusion has no cache policy to choose, the prefix cache and chunked prefill are on):
  l20  LLaDA2.0's official rule (threshold 0.95), greedy admission
  l20l l20 with lookahead admission
  l21q LLaDA2.1 quality mode (token editing), greedy admission
  l21s LLaDA2.1 speed mode, greedy admission

KV usage: while each `vllm bench serve` run is in flight a background thread polls
/metrics (every --poll-interval s) for vLLM's gauges vllm:kv_cache_usage_perc and
vllm:num_requests_running / _waiting; results record their peak and mean (table.md:
peak and mean KV usage, peak running requests).  With a KV-limited pool
(--kv-cache-bytes) this shows how many requests each configuration admits at once.

Workloads: random prompts of three shapes (burst, osc, livebench), and `tasks`: the
shipped task model's held-out prompts (an equal mix of the four tasks, chat template
applied by the client, each with its task's canvas length), for configurations whose
decoding depends on what the model is sure of (use --model with the task model);
`hard-tasks` the same over the four multi-step tasks (sort, multiply, chain, brackets;
the LLaDA2 task model's), where LLaDA2.1's editing has tokens to rewrite.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # lab/ sits at the repository root

ROOT = pathlib.Path(__file__).resolve().parent.parent
BIN = pathlib.Path(sys.executable).parent

CONFIGS = {
    "a": {"cache": "none", "admission": "static"},
    "b": {"cache": "dual", "admission": "reserve"},
    "c": {"cache": "dual", "admission": "greedy"},
    "d": {"cache": "dual", "admission": "lookahead"},
    "e": {"cache": "dual", "admission": "greedy", "decoding": "threshold", "threshold": 0.9},
    "s5": {"cache": "sparse", "admission": "greedy", "retention": 0.5},
    "s3": {"cache": "sparse", "admission": "greedy", "retention": 0.3},
    "l20": {"admission": "greedy"},
    "l20l": {"admission": "lookahead"},
    "l21q": {"admission": "greedy", "mode": "quality"},
    "l21s": {"admission": "greedy", "mode": "speed"},
}
LABELS = {
    "a": "(a) exact, static batching",
    "b": "(b) dual cache, request-level",
    "c": "(c) dual cache, phase-multiplexed",
    "d": "(d) (c) + lookahead admission",
    "e": "(e) (c) + threshold decoding",
    "s5": "(s5) (c) + sparse KV, retention 0.5",
    "s3": "(s3) (c) + sparse KV, retention 0.3",
    "l20": "(l20) LLaDA2.0 rule, greedy",
    "l20l": "(l20l) LLaDA2.0 rule, lookahead",
    "l21q": "(l21q) LLaDA2.1 quality, greedy",
    "l21s": "(l21s) LLaDA2.1 speed, greedy",
}
# Shapes after the dLLM-Serve paper's workloads, scaled to a 2-core CPU.
WORKLOADS = {
    # bursty gamma arrivals, mixed lengths
    "burst": ["--random-input-len", "96", "--random-output-len", "64", "--random-range-ratio", "0.5", "--burstiness", "0.5"],
    # long prompt, short output
    "osc": ["--random-input-len", "320", "--random-output-len", "32", "--random-range-ratio", "0"],
    # short prompt, long output
    "livebench": ["--random-input-len", "32", "--random-output-len", "192", "--random-range-ratio", "0"],
}


# The task workloads: which task group (lab.tasks.TASK_GROUPS) each draws from.
TASK_WORKLOADS = {"tasks": "all", "hard-tasks": "hard"}


def task_prompts(path: pathlib.Path, count: int, group: str = "all", seed: int = 0) -> pathlib.Path:
    """A custom-dataset file of held-out task prompts: {"prompt", "output_tokens"} lines."""
    import random

    from lab.tasks import ALL_TASKS, TASK_GROUPS, TEST

    rng = random.Random(seed)
    names = sorted(TASK_GROUPS[group])
    lines = []
    for i in range(count):
        task = ALL_TASKS[names[i % len(names)]]
        lines.append(json.dumps({"prompt": task.sample(rng, TEST).prompt, "output_tokens": task.gen_length}))
    path.write_text("\n".join(lines) + "\n")
    return path


def dataset_args(workload: str, args) -> list[str]:
    if workload in TASK_WORKLOADS:
        path = task_prompts(args.out / f"{workload}-prompts.jsonl", args.num_prompts, TASK_WORKLOADS[workload])
        # -1: each prompt's own output_tokens (the default is a fixed 256).
        return ["--dataset-name", "custom", "--dataset-path", str(path), "--custom-output-len", "-1"]
    return ["--dataset-name", "random", *WORKLOADS[workload]]
METRICS = [
    "vllm:diffusion_num_denoising_steps_total",
    "vllm:diffusion_num_committed_tokens_total",
    "vllm:diffusion_num_refresh_steps_total",
    "vllm:diffusion_num_reuse_steps_total",
    "vllm:diffusion_num_delayed_steps_total",
]


# vLLM's own gauges, polled during each run (kv_cache_usage_perc is a fraction in [0, 1]).
GAUGES = {
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    # the plugin's: KV slots the running requests hold, and would hold dense
    "vllm:diffusion_kv_slots": "kv_slots",
    "vllm:diffusion_kv_dense_slots": "kv_dense_slots",
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def scrape(base: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{base}/metrics", timeout=30).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in METRICS:
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def scrape_gauges(base: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in GAUGES:
            key = GAUGES[name]
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


class GaugePoller:
    """Polls the server's gauges in a background thread while a run is in flight."""

    def __init__(self, base: str, interval: float):
        self.base, self.interval = base, interval
        self.samples: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(scrape_gauges(self.base))
            except OSError:
                pass
            self._stop.wait(self.interval)

    def __enter__(self) -> "GaugePoller":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        def values(key):
            return [s[key] for s in self.samples if key in s]

        kv, running, waiting = values("kv_usage"), values("running"), values("waiting")
        return {
            "kv_usage_peak": round(max(kv), 4) if kv else None,
            "kv_usage_mean": round(sum(kv) / len(kv), 4) if kv else None,
            "running_peak": int(max(running)) if running else None,
            "running_mean": round(sum(running) / len(running), 2) if running else None,
            "waiting_peak": int(max(waiting)) if waiting else None,
            "kv_slots_peak": int(max(values("kv_slots"))) if values("kv_slots") else None,
            "kv_dense_slots_peak": int(max(values("kv_dense_slots"))) if values("kv_dense_slots") else None,
            "gauge_samples": len(self.samples),
        }


class Server:
    def __init__(self, model: str, config: dict, args, log: pathlib.Path):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        dllm = {**config, "block_length": args.block_length}
        cmd = [
            str(BIN / "vllm"), "serve", model, "--host", "127.0.0.1", "--port", str(self.port),
            "--max-model-len", str(args.max_model_len), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--max-num-seqs", str(args.max_num_seqs), "--kv-cache-memory-bytes", str(args.kv_cache_bytes),
            "--gpu-memory-utilization", "0.3", "--enforce-eager", "--shutdown-timeout", "10",
            "--additional-config", json.dumps({"dllm": dllm}),
        ]
        if args.block_size is not None:
            cmd += ["--block-size", str(args.block_size)]
        self.log = log.open("w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited; see {log}")
            try:
                urllib.request.urlopen(f"{self.base}/health", timeout=2)
                return
            except OSError:
                time.sleep(2)
        self.stop()
        raise RuntimeError(f"server did not become healthy; see {log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


def bench(server: Server, model: str, workload: str, rate: float, args, result_dir: pathlib.Path) -> dict:
    name = f"{workload}-rate{rate}"
    cmd = [
        str(BIN / "vllm"), "bench", "serve", "--backend", "vllm", "--base-url", server.base, "--model", model,
        *dataset_args(workload, args), "--request-rate", str(rate),
        "--num-prompts", str(args.num_prompts), "--seed", "0", "--ignore-eos",
        "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(result_dir), "--result-filename", f"{name}.json",
    ]
    result_dir.mkdir(parents=True, exist_ok=True)
    before = scrape(server.base)
    started = time.time()
    with GaugePoller(server.base, args.poll_interval) as poller:
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=args.run_timeout)
    wall = time.time() - started
    after = scrape(server.base)
    raw = json.loads((result_dir / f"{name}.json").read_text())
    deltas = {k.removeprefix("vllm:diffusion_num_").removesuffix("_total"): after.get(k, 0) - before.get(k, 0) for k in METRICS}
    return {
        "workload": workload,
        "rate": rate,
        "completed": raw.get("completed"),
        "committed_tok_s": raw.get("output_throughput"),
        "mean_e2el_ms": raw.get("mean_e2el_ms"),
        "p99_e2el_ms": raw.get("p99_e2el_ms"),
        "mean_ttft_ms": raw.get("mean_ttft_ms"),
        "wall_s": round(wall, 1),
        **deltas,
        **poller.summary(),
    }


def write_report(results: dict, out: pathlib.Path, baseline: str = "b") -> None:
    x = f"x ({baseline})"
    rows = [f"| workload | rate | config | committed tok/s | {x} | mean latency s | {x} | p99 latency s | {x} | delayed steps "
            "| peak KV usage | mean KV usage | peak running |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for workload in sorted({r["workload"] for rs in results.values() for r in rs}):
        rates = sorted({r["rate"] for rs in results.values() for r in rs if r["workload"] == workload})
        for rate in rates:
            base = next((r for r in results.get(baseline, []) if r["workload"] == workload and r["rate"] == rate), None)
            for config, rs in results.items():
                r = next((x for x in rs if x["workload"] == workload and x["rate"] == rate), None)
                if r is None:
                    continue

                def ratio(key, invert=False):
                    if base is None or not base.get(key) or not r.get(key):
                        return "n/a"
                    value = base[key] / r[key] if invert else r[key] / base[key]
                    return f"{value:.2f}"

                def share(key):
                    return "n/a" if r.get(key) is None else f"{r[key]:.1%}"

                rows.append(
                    f"| {workload} | {rate} | {config} | {r['committed_tok_s']:.1f} | {ratio('committed_tok_s')} | "
                    f"{r['mean_e2el_ms'] / 1000:.2f} | {ratio('mean_e2el_ms', True)} | {r['p99_e2el_ms'] / 1000:.2f} | "
                    f"{ratio('p99_e2el_ms', True)} | {int(r.get('delayed_steps', 0))} | {share('kv_usage_peak')} | "
                    f"{share('kv_usage_mean')} | {r.get('running_peak', 'n/a')} |"
                )
    notes = (f"Latency ratios are ({baseline}) / config: above 1 means lower latency than ({baseline}).\n"
             "KV usage and running requests: vLLM's gauges vllm:kv_cache_usage_perc and "
             "vllm:num_requests_running, polled from /metrics while the run was in flight (the mean "
             "includes the run's ramp-up and drain).\n")
    (out / "table.md").write_text("\n".join(rows) + "\n\n" + notes)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots (pip install 'vllm-dllm[bench]')")
        return
    for workload in sorted({r["workload"] for rs in results.values() for r in rs}):
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for config, rs in results.items():
            pts = sorted((r["rate"], r) for r in rs if r["workload"] == workload)
            if not pts:
                continue
            rates = [p[0] for p in pts]
            (line,) = axes[0].plot(rates, [p[1]["committed_tok_s"] for p in pts], marker="o", label=LABELS[config])
            color = line.get_color()
            axes[1].plot(rates, [p[1]["mean_e2el_ms"] / 1000 for p in pts], marker="o", color=color, label=f"{config} mean")
            axes[1].plot(rates, [p[1]["p99_e2el_ms"] / 1000 for p in pts], marker="x", linestyle="--", color=color, label=f"{config} p99")
        axes[0].set(title=f"{workload}: committed throughput", xlabel="request rate (req/s)", ylabel="tokens/s")
        axes[1].set(title=f"{workload}: latency", xlabel="request rate (req/s)", ylabel="seconds")
        axes[0].legend(fontsize=7)
        axes[1].legend(fontsize=7, ncol=2)
        fig.tight_layout()
        fig.savefig(out / f"{workload}.png", dpi=110)
        plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: a generated model of --arch)")
    ap.add_argument("--arch", default="llada", choices=["llada", "llada2"],
                    help="format of the generated model (configs l20, l20l, l21q, l21s need llada2)")
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "benchmarks" / "results" / "scheduling")
    ap.add_argument("--configs", default="a,b,c,d")
    ap.add_argument("--workloads", default="burst,osc,livebench")
    ap.add_argument("--rates", default="1,2,4")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--block-length", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--kv-cache-bytes", type=int, default=512 << 20)
    ap.add_argument("--block-size", type=int, default=None, help="KV block size (default: the plugin's, 128 on CPU)")
    ap.add_argument("--poll-interval", type=float, default=0.5, help="seconds between /metrics gauge polls")
    ap.add_argument("--run-timeout", type=int, default=1800)
    ap.add_argument("--hidden", type=int, default=256, help="size of the generated model")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--baseline", default="b", help="the configuration ratios are taken against")
    args = ap.parse_args(argv)

    args.out.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None:
        from vllm_dllm.tools.make_tiny import make_tiny

        model = str(make_tiny(args.arch, args.out / "model", seed=0, hidden=args.hidden, layers=args.layers,
                              heads=args.hidden // 64, intermediate=args.hidden * 3, max_len=args.max_model_len))
    results: dict[str, list[dict]] = {}
    for config in args.configs.split(","):
        server = Server(model, CONFIGS[config], args, args.out / f"server-{config}.log")
        try:
            for workload in args.workloads.split(","):
                for rate in [float(r) for r in args.rates.split(",")]:
                    row = bench(server, model, workload, rate, args, args.out / "raw" / config)
                    results.setdefault(config, []).append(row)
                    print(json.dumps({"config": config, **row}), flush=True)
        finally:
            server.stop()
    (args.out / "results.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=2) + "\n")
    write_report(results, args.out, args.baseline)
    print((args.out / "table.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
