"""Worker-side timing for benchmarks/engine_overhead.py: /proc probes of CPU time and
affinity, and the mixin vLLM adds to its worker class (`worker_extension_cls`
"worker_timing.TimingExtension"; this directory must be on the worker's PYTHONPATH).

The mixin wraps, on the instances, the runner's `execute_model`, the model's
`forward` and its `compute_logits` with timers, and can run torch.profiler over the
worker for a while; no vLLM or plugin code is changed.
"""

from __future__ import annotations

import os
import pathlib
import time


def cpus_allowed(pid: int | str = "self") -> str:
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "?"


def thread_affinities(pid: int | str = "self") -> dict[str, int]:
    """Cpus_allowed_list of every thread of a process -> how many threads."""
    out: dict[str, int] = {}
    task_dir = pathlib.Path(f"/proc/{pid}/task")
    for task in task_dir.iterdir() if task_dir.exists() else []:
        allowed = cpus_allowed(f"{pid}/task/{task.name}")
        out[allowed] = out.get(allowed, 0) + 1
    return out


def cpu_seconds(pid: int | str = "self") -> float | None:
    """utime + stime of a process (all its threads), from /proc."""
    try:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def machine_busy_seconds() -> float | None:
    """CPU seconds the whole machine has spent not idle, from /proc/stat."""
    try:
        fields = [int(x) for x in pathlib.Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class TimingExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`); called through
    `LLM.collective_rpc("dllm_bench_*")`.  Times are time.perf_counter, which is
    CLOCK_MONOTONIC on Linux and so comparable with the front end's."""

    def dllm_bench_install(self) -> dict:
        import torch
        import vllm_dllm

        runner = self.model_runner
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        self._dllm_bench = {}
        self.dllm_bench_reset()
        bench = self._dllm_bench
        clock = time.perf_counter

        def timed(obj, name, key):
            original = getattr(obj, name)

            def wrapper(*args, **kwargs):
                start = clock()
                out = original(*args, **kwargs)
                bench["cur"][key + "_s"] += clock() - start
                bench["cur"][key + "_calls"] += 1
                if args and hasattr(args[0], "shape"):
                    bench["cur"][key + "_rows"] += int(args[0].shape[0])
                return out

            setattr(obj, name, wrapper)

        original_execute = runner.execute_model

        def execute_model(scheduler_output, *args, **kwargs):
            cur = bench["cur"] = dict(forward_s=0.0, forward_calls=0, forward_rows=0,
                                      logits_s=0.0, logits_calls=0, logits_rows=0)
            start = clock()
            out = original_execute(scheduler_output, *args, **kwargs)
            end = clock()
            if scheduler_output.total_num_scheduled_tokens > 0:
                cur.update(start=start, end=end,
                           batch=len(scheduler_output.num_scheduled_tokens),
                           tokens=scheduler_output.total_num_scheduled_tokens)
                bench["steps"].append(cur)
            else:
                bench["empty_steps"] += 1
            return out

        runner.execute_model = execute_model
        timed(model, "forward", "forward")
        timed(model, "compute_logits", "logits")
        env = {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_", "KMP_", "VLLM_CPU_"))}
        return {
            "pid": os.getpid(),
            "vllm_dllm_file": vllm_dllm.__file__,
            "runner_class": f"{type(runner).__module__}.{type(runner).__qualname__}",
            "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
            "torch_num_threads": torch.get_num_threads(),
            "worker_cpus_allowed": cpus_allowed(),
            "parent_pid": os.getppid(),
            "parent_cpus_allowed": cpus_allowed(os.getppid()),
            "omp_env": env,
            "compilation_mode": str(self.vllm_config.compilation_config.mode),
        }

    def dllm_bench_reset(self) -> None:
        self._dllm_bench.clear()
        self._dllm_bench.update(
            steps=[], empty_steps=0, cur=None,
            cpu_self=cpu_seconds(), cpu_parent=cpu_seconds(os.getppid()),
        )

    def dllm_bench_profile_start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self._dllm_profile = profile(activities=[ProfilerActivity.CPU])
        self._dllm_profile.__enter__()

    def dllm_bench_profile_stop(self, top: int) -> list[dict]:
        """The worker's torch ops while the profiler ran, the costliest first by self
        CPU time (the profiler's own overhead included)."""
        profiler = self._dllm_profile
        profiler.__exit__(None, None, None)
        events = sorted(profiler.key_averages(), key=lambda e: -e.self_cpu_time_total)
        return [{"op": e.key, "self_ms": e.self_cpu_time_total / 1000, "calls": e.count} for e in events[:top]]

    def dllm_bench_stats(self) -> dict:
        import torch

        bench = self._dllm_bench
        cpu_self, cpu_parent = cpu_seconds(), cpu_seconds(os.getppid())
        return {
            "steps": bench["steps"],
            "empty_steps": bench["empty_steps"],
            "worker_cpu_s": cpu_self - bench["cpu_self"] if cpu_self is not None else None,
            # The engine-core process when the executor is multiprocess.
            "parent_cpu_s": cpu_parent - bench["cpu_parent"] if cpu_parent is not None else None,
            "torch_num_threads": torch.get_num_threads(),
            # Per-thread affinity after OpenMP has started its pool.
            "worker_thread_affinities": thread_affinities(),
        }
