"""The markdown tables of benchmarks/engine_overhead.py: one row per CPU setting, where
the wall time went, and the worker's costliest ops when --profile-ops ran."""

from __future__ import annotations


def _fmt(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def table(label: str, results: list[dict]) -> str:
    tree = results[0]["tree"] if results else {}
    lines = [
        f"### Engine overhead: `{label}`",
        "",
        f"Tree {tree.get('path', '?')} at {tree.get('head', '?')[:10]}{' (dirty)' if tree.get('dirty') else ''}; "
        f"{results[0]['workload']['num_requests'] if results else '?'} requests x 32-token canvas, block 8, "
        "32 steps, dual cache. Each row is the "
        "median measured generate (by wall time) of that setting; ranges over all of them. "
        "2-core CPU shared with other work: noisy (last column: CPU seconds other "
        "processes used during that generate).",
        "",
        "| setting | worker threads (cpus) | steps | batch | wall s (min-max) | ms/step (min) | runner ms/step "
        "| forward ms/step | logits ms/step | overhead | tok/s | other procs CPU s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        w = r["worker"]
        lines.append("| " + " | ".join([
            r["setting"],
            f"{w['torch_num_threads']} ({', '.join(sorted(r['worker_thread_affinities']))})",
            f"{r['steps']} ({min(r['steps_all'])}-{max(r['steps_all'])})",
            f"{r['batch_size_min']}-{r['batch_size_max']}",
            f"{r['wall_s']:.3f} ({min(r['wall_s_all']):.3f}-{max(r['wall_s_all']):.3f})",
            f"{r['ms_per_step']:.2f} ({r['ms_per_step_min']:.2f})",
            _fmt(r["runner_ms_per_step"], "{:.2f}"),
            _fmt(r["forward_ms_per_step"], "{:.2f}"),
            _fmt(r["logits_ms_per_step"], "{:.2f}"),
            _fmt(r["overhead_fraction"], "{:.1%}"),
            _fmt(r["committed_tokens_per_s"], "{:.0f}"),
            _fmt(r.get("other_processes_cpu_s"), "{:.2f}"),
        ]) + " |")
    lines += [
        "",
        "Where the wall time went (ms, same run): head = generate() called to first step; "
        "runner other = execute_model minus forward and logits; between steps = scheduler, "
        "IPC and output processing; CPU s = CPU time of each process during the generate.",
        "",
        "| setting | head | forward | logits | runner other | between steps | tail "
        "| Refresh step fwd ms (n) | Reuse step fwd ms (n) | CPU s worker / engine core / front end / other processes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        b = r["breakdown_ms"]
        ref, reu = r.get("refresh_steps"), r.get("reuse_steps")
        lines.append("| " + " | ".join([
            r["setting"],
            *(_fmt(b[k], "{:.0f}") for k in ("head", "forward", "logits", "runner_other", "between_steps", "tail")),
            f"{ref['forward_ms']:.1f} ({ref['steps']})" if ref else "-",
            f"{reu['forward_ms']:.1f} ({reu['steps']})" if reu else "-",
            " / ".join(_fmt(r.get(k), "{:.2f}") for k in ("worker_cpu_s", "engine_core_cpu_s", "frontend_cpu_s",
                                                         "other_processes_cpu_s")),
        ]) + " |")
    for r in results:
        lines += op_profile_table(r["setting"], r.get("op_profile"))
    return "\n".join(lines)


def op_profile_table(setting: str, profile: dict | None) -> list[str]:
    """The worker's costliest torch ops per engine step (--profile-ops), from the
    setting's first process."""
    if not profile or not profile["steps"]:
        return []
    steps = profile["steps"]
    lines = [
        "",
        f"Worker ops of `{setting}` under torch.profiler: one extra generate, {steps} engine steps, "
        f"{profile['wall_s'] * 1000 / steps:.2f} ms/step with the profiler on (it adds host time to every op).",
        "",
        "| op | self ms/step | calls/step | us/call |",
        "|---|---|---|---|",
    ]
    for op in profile["ops"]:
        lines.append(f"| `{op['op']}` | {op['self_ms'] / steps:.3f} | {op['calls'] / steps:.1f} "
                     f"| {op['self_ms'] * 1000 / max(op['calls'], 1):.1f} |")
    return lines
