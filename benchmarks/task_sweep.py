"""Shared by the accuracy benchmarks: held-out task instances decoded offline through
the plugin under a list of settings, one engine for all of them."""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # lab/ sits at the repository root
from lab import eval as task_eval  # noqa: E402
from vllm_dllm.default_model import PATH as DEFAULT_MODEL  # noqa: E402
from lab.tasks import ALL_TASKS  # noqa: E402

# Block length per task: short canvases in two blocks, long ones in blocks of 8.
BLOCKS = {"retrieval": 4, "addition": 4, "copy": 8, "reverse": 8}
ENGINE = dict(max_model_len=512, max_num_seqs=64, kv_cache_memory_bytes=512 << 20, gpu_memory_utilization=0.3)


def add_task_arguments(ap, n: int) -> None:
    """--model, --n (instances per task and setting) and --seed (which instances)."""
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--n", type=int, default=n)
    ap.add_argument("--seed", type=int, default=0)


def save_task_figure(fig, axes, path, legend_loc: str) -> None:
    """Accuracy panels, one per task: shared y label, legend on the last one."""
    axes[0].set_ylabel("exact match")
    axes[-1].legend(fontsize=7, loc=legend_loc)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def task_panels(rows: list[dict]):
    """(pyplot, figure, axes, tasks): one accuracy panel per task of `rows`, in order."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(r["task"] for r in rows))
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.8), sharey=True, squeeze=False)
    return plt, fig, axes[0], tasks


def run_points(model: str, points: list[tuple[dict, str, dict]], n: int, seed: int,
               counters: dict[str, str] | None = None) -> list[dict]:
    """Each point is (labels, task, xargs); returns one row per point: the labels,
    the xargs and the task result (lab.eval.TaskResult's fields), plus per
    request the growth of each of the plugin's `counters` (row key -> metric name)."""
    import prometheus_client

    runner = task_eval.OfflineRunner(model, ENGINE)
    counters = counters or {}

    def read(metric: str) -> float:
        return prometheus_client.REGISTRY.get_sample_value(metric, runner.labels) or 0.0

    rows = []
    try:
        for labels, task, xargs in points:
            before = {key: read(metric) for key, metric in counters.items()}
            result = task_eval.evaluate_task(runner, ALL_TASKS[task], n, seed, xargs)
            grown = {key: (read(metric) - before[key]) / n for key, metric in counters.items()}
            rows.append({**labels, "xargs": xargs, **vars(result), **grown})
            steps = f"{result.steps_per_token:.3f}" if result.steps_per_token is not None else "-"
            print(f"{' '.join(map(str, labels.values())):28s} {task:10s} {result.accuracy:6.1%}  "
                  f"chars {result.char_accuracy:6.1%}  steps/token {steps}  {result.tokens_per_s:7.1f} tok/s",
                  flush=True)
    finally:
        runner.engine.engine_core.shutdown()
    return rows
