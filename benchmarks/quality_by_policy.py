"""Task accuracy of the shipped model under each KV-reuse policy, against exact decoding.

    python benchmarks/quality_by_policy.py --n 200 --out benchmarks/results/quality

One engine (offline, through the plugin) decodes the same held-out instances of every
task under each policy and writes quality.json and quality.md.  Every policy uses
steps = canvas length (one token per step), so the only differences are the block
schedule and where K/V comes from:

  exact           cache none, one block over the whole canvas (the accuracy targets)
  blocks          cache none, semi-autoregressive blocks (what the caches build on)
  prefix          prefix cache: Reuse steps recompute the block and everything after it
  dual            dual cache: Reuse steps recompute the block only
  dual+refresh4   dual cache, refreshed every 4 steps inside a block as well
  dual+delay1     dual cache filled one step late (Sparse-dLLM's delayed fill)
  vicinityN       vicinity cache: Reuse steps recompute the block and N positions on
                  each side of it (dInfer's Vicinity Refresh)
  ...+threshold   the same cache under Fast-dLLM's threshold rule (0.9): several
                  tokens a step where the model is confident, fewer forwards
  ...+smooth      IterSmooth (dInfer): each still-masked position's expected
                  embedding fed back at the next step (and under the threshold
                  rule, the threshold falling from 1 to 0.9 over the first steps;
                  ...+smooth-flat: the threshold at 0.9 from the start)

Each row also gives the query tokens a request's forwards ran (the price the
scheduler charges), from the plugin's per-step histogram.
"""

from __future__ import annotations

import sys

import argparse
import json
import pathlib

from task_sweep import BLOCKS, add_task_arguments, run_points

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # lab/ sits at the repository root
from lab.tasks import TASKS  # noqa: E402

POLICIES = {
    "exact": None,
    "blocks": {"cache": "none"},
    "prefix": {"cache": "prefix"},
    "dual": {"cache": "dual"},
    "dual+refresh4": {"cache": "dual", "refresh_interval": 4},
    "dual+delay1": {"cache": "dual", "delay_step": 1},
    "vicinity4": {"cache": "vicinity", "vicinity": 4},
    "vicinity16": {"cache": "vicinity", "vicinity": 16},
    "dual+threshold": {"cache": "dual", "decoding": "threshold", "threshold": 0.9},
    "vicinity4+threshold": {"cache": "vicinity", "vicinity": 4, "decoding": "threshold", "threshold": 0.9},
    "blocks+smooth": {"cache": "none", "iter_smooth": True},
    "dual+smooth": {"cache": "dual", "iter_smooth": True},
    "dual+threshold+smooth": {"cache": "dual", "decoding": "threshold", "threshold": 0.9, "iter_smooth": True},
    "dual+threshold+smooth-flat": {"cache": "dual", "decoding": "threshold", "threshold": 0.9, "iter_smooth": True,
                                   "smooth_threshold_decay": 0.0},
}
QUERY_TOKENS = "vllm:diffusion_scheduled_query_tokens_per_step_sum"


def xargs_for(policy: str, task: str) -> dict:
    options = POLICIES[policy]
    if options is None:
        return {}
    return {"block_length": BLOCKS[task], **options}


def write_table(rows: list[dict], out: pathlib.Path) -> None:
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    by_key = {(r["policy"], r["task"]): r for r in rows}
    lines = [
        "Exact-match accuracy [95% interval] / characters in place / denoising steps per token /"
        " query tokens per request, per task.",
        "",
        "| policy | " + " | ".join(tasks) + " |",
        "|---|" + "---|" * len(tasks),
    ]
    for policy in dict.fromkeys(r["policy"] for r in rows):
        cells = []
        for task in tasks:
            r = by_key[(policy, task)]
            low, high = r["ci95"]
            steps = "-" if r.get("steps_per_token") is None else f"{r['steps_per_token']:.2f}"
            cells.append(f"{r['accuracy']:.1%} [{low:.0%}, {high:.0%}] / {r['char_accuracy']:.0%} / {steps}"
                         f" / {r.get('query_tokens', 0):.0f}")
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    (out / "quality.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_task_arguments(ap, n=200)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results/quality"))
    args = ap.parse_args(argv)

    args.out.mkdir(parents=True, exist_ok=True)
    points = [({"policy": policy}, task, xargs_for(policy, task))
              for policy in args.policies.split(",") for task in args.tasks.split(",")]
    rows = run_points(args.model, points, args.n, args.seed, counters={"query_tokens": QUERY_TOKENS})
    (args.out / "quality.json").write_text(json.dumps({"model": args.model, "n": args.n, "rows": rows}, indent=2) + "\n")
    write_table(rows, args.out)
    print((args.out / "quality.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
