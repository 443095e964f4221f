"""Accuracy against denoising steps for every parallel decoding rule, on the shipped
task model, with and without the dual KV cache.

    python benchmarks/parallel_decoding.py --n 100 --out benchmarks/results/parallel-decoding

One engine (offline, through the plugin) decodes the same held-out instances of every
task under each setting.  Every setting uses steps = canvas length (the fixed schedule
commits one token per step, so the rules are exactly their published definitions) and
the same blocks per task; `fixed` is the reference point of each cache policy.
Reported per (setting, cache, task): exact-match accuracy with its 95% interval,
denoising steps per generated token (the plugin's counter over the tokens the
requests returned), committed tokens per step, and the step reduction against `fixed`
under the same cache.  Writes results.json, results.md and accuracy_vs_steps.png.
"""

from __future__ import annotations

import sys

import argparse
import json
import pathlib

from task_sweep import BLOCKS, add_task_arguments, run_points, save_task_figure, task_panels

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # lab/ sits at the repository root
from lab.tasks import TASKS  # noqa: E402

CACHES = {"none": {"cache": "none"}, "dual": {"cache": "dual"}}
SETTINGS = {
    "fixed": {},
    **{f"threshold {t}": {"decoding": "threshold", "threshold": t} for t in (0.5, 0.7, 0.8, 0.9, 0.95)},
    **{f"factor {f}": {"decoding": "factor", "factor": f} for f in (0.5, 1.0, 2.0)},
    **{f"entropy_bound {g}": {"decoding": "entropy_bound", "gamma": g} for g in (0.1, 0.5, 1.0, 2.0)},
    **{f"hierarchy {h}/{lo}": {"decoding": "hierarchy", "threshold": h, "low_threshold": lo}
       for h, lo in ((0.9, 0.3), (0.9, 0.6), (0.8, 0.5))},
    **{f"credit {t}": {"decoding": "credit", "threshold": t} for t in (0.9, 0.8)},
}


def xargs_for(setting: str, cache: str, task: str) -> dict:
    return {"block_length": BLOCKS[task], **CACHES[cache], **SETTINGS[setting]}


def write_table(rows: list[dict], out: pathlib.Path) -> None:
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    by_key = {(r["setting"], r["cache"], r["task"]): r for r in rows}
    lines = [
        "Exact-match accuracy [95% interval] / denoising steps per token (x fewer steps than `fixed`), per task.",
        "",
        "| setting | cache | " + " | ".join(tasks) + " |",
        "|---|---|" + "---|" * len(tasks),
    ]
    for setting in dict.fromkeys(r["setting"] for r in rows):
        for cache in dict.fromkeys(r["cache"] for r in rows):
            cells = []
            for task in tasks:
                r = by_key.get((setting, cache, task))
                if r is None:
                    cells.append("-")
                    continue
                low, high = r["ci95"]
                cells.append(f"{r['accuracy']:.1%} [{low:.0%}, {high:.0%}] / {r['steps_per_token']:.2f} "
                             f"({r['step_reduction']:.1f}x)")
            lines.append(f"| {setting} | {cache} | " + " | ".join(cells) + " |")
    (out / "results.md").write_text("\n".join(lines) + "\n")


def plot(rows: list[dict], out: pathlib.Path) -> None:
    _, fig, axes, tasks = task_panels(rows)
    for ax, task in zip(axes, tasks):
        for cache, marker in (("none", "o"), ("dual", "s")):
            for rule in dict.fromkeys(r["setting"].split()[0] for r in rows):
                pts = sorted((r["tokens_per_step"], r["accuracy"]) for r in rows
                             if r["task"] == task and r["cache"] == cache and r["setting"].split()[0] == rule)
                if pts:
                    ax.plot(*zip(*pts), marker=marker, label=f"{rule} ({cache})", alpha=0.8)
        ax.set_title(task)
        ax.set_xlabel("committed tokens per step")
        ax.grid(alpha=0.3)
    save_task_figure(fig, axes, out / "accuracy_vs_steps.png", legend_loc="lower left")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_task_arguments(ap, n=100)
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--caches", default=",".join(CACHES))
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results/parallel-decoding"))
    args = ap.parse_args(argv)

    args.out.mkdir(parents=True, exist_ok=True)
    points = [({"setting": setting, "cache": cache}, task, xargs_for(setting, cache, task))
              for cache in args.caches.split(",") for setting in args.settings.split(",")
              for task in args.tasks.split(",")]
    rows = run_points(args.model, points, args.n, args.seed)
    for row in rows:
        row["tokens_per_step"] = 1 / row["steps_per_token"] if row["steps_per_token"] else None
    reference = {(r["cache"], r["task"]): r["steps_per_token"] for r in rows if r["setting"] == "fixed"}
    for r in rows:
        base = reference.get((r["cache"], r["task"]))
        r["step_reduction"] = base / r["steps_per_token"] if base and r["steps_per_token"] else float("nan")
    (args.out / "results.json").write_text(
        json.dumps({"model": args.model, "n": args.n, "seed": args.seed, "rows": rows}, indent=2) + "\n")
    write_table(rows, args.out)
    plot(rows, args.out)
    print((args.out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
