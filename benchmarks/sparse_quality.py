"""Task accuracy of the shipped model under the sparse KV cache, against exact decoding
and the dense dual cache, over retention and selection.

    python benchmarks/sparse_quality.py --n 500 --out benchmarks/results/sparse-quality

One engine (offline, through the plugin) decodes the same held-out instances (same
seed, so every comparison is paired) of every task under each setting.  Every setting
uses steps = canvas length (one token per step) and the same blocks per task:

  exact           cache none, one block over the whole canvas (the accuracy targets)
  dual            dual cache (dense K/V of every position, no delay: Fast-dLLM's)
  dual+delay1     dual cache with delay_step 1: the sparse policy's own delay, so
                  sparse vs dual+delay1 isolates the effect of dropping positions
  sparse r s      cache sparse, retention r, selection s (head: every KV head keeps
                  its own top-k context positions; uniform: one set shared by all
                  heads); delay_step 1, the selection's own pool_kernel (head 1
                  below retention 0.4 and 3 from it, uniform 3; --pool-kernels sets
                  one for both) and scoring (head: the
                  largest attention weight a block query gives a position, weight;
                  uniform: its largest logit, max)
  sparse r s X    the same scored by X (--scorings): max, weight, or mean (the mean
                  query's logit); uniform mean is Sparse-dLLM's own method

Writes results.json (one row per setting and task), results.md (accuracy [95% Wilson
interval] per setting and task, and a computed check: head vs uniform per retention
and task, and retrieval at r=0.5 against dual) and accuracy_vs_retention.png;
`--from-results` redraws the last two from an existing results.json.
"""

from __future__ import annotations

import sys

import argparse
import json
import math
import pathlib

from task_sweep import BLOCKS, add_task_arguments, run_points, save_task_figure, task_panels

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # lab/ sits at the repository root
from lab.tasks import TASKS  # noqa: E402
from vllm_dllm.options.sparse_defaults import SCORINGS as DEFAULT_SCORINGS  # noqa: E402

RETENTIONS = (0.1, 0.2, 0.3, 0.5, 1.0)
SELECTIONS = ("head", "uniform")
SCORINGS = ("default", "mean")  # default: each selection's own
DENSE = {
    "exact": None,
    "dual": {"cache": "dual"},
    "dual+delay1": {"cache": "dual", "delay_step": 1},
}


def settings(retentions, selections, scorings, delays=(1,), pools=(0,), references=tuple(DENSE)
             ) -> list[tuple[dict, dict | None]]:
    """(labels, options) per setting; options None is exact decoding (no xargs)."""
    out = [({"policy": name, "retention": None, "selection": None, "scoring": None}, DENSE[name])
           for name in references]
    for delay, pool in ((d, k) for d in delays for k in pools):
        for scoring in scorings:
            for r in retentions:
                if scoring != "default" and r == 1.0:
                    continue  # everything is kept: the scoring cannot matter
                for s in selections:
                    labels = {"policy": "sparse", "retention": r, "selection": s,
                              "scoring": DEFAULT_SCORINGS[s] if scoring == "default" else scoring}
                    options = {"cache": "sparse", "retention": r, "selection": s}
                    if scoring != "default":
                        options["scoring"] = scoring
                    if delay != 1:  # 1 is sparse's default
                        labels["delay_step"] = options["delay_step"] = delay
                    if pool:  # 0: the selection's default pool_kernel
                        labels["pool_kernel"] = options["pool_kernel"] = pool
                    out.append((labels, options))
    return out


def default_knobs(row: dict) -> bool:
    """The selection's own delay and pooling (any scoring)."""
    return row.get("delay_step", 1) == 1 and "pool_kernel" not in row


def default_scoring(row: dict) -> bool:
    return row.get("scoring") == DEFAULT_SCORINGS[row["selection"]]


def xargs_for(options: dict | None, task: str) -> dict:
    if options is None:
        return {}
    return {"block_length": BLOCKS[task], **options}


def setting_name(row: dict) -> str:
    if row["policy"] != "sparse":
        return row["policy"]
    scoring = "" if row.get("scoring") == DEFAULT_SCORINGS[row["selection"]] else f" {row.get('scoring')}"
    delay = "" if row.get("delay_step", 1) == 1 else f" delay{row['delay_step']}"
    pool = f" pool{row['pool_kernel']}" if "pool_kernel" in row else ""
    return f"sparse r={row['retention']:g} {row['selection']}{scoring}{delay}{pool}"


def newcombe(r1: dict, r2: dict) -> tuple[float, float]:
    """95% interval of accuracy(r1) - accuracy(r2) from the two Wilson intervals
    (Newcombe's hybrid score method).  It treats the two samples as independent, so
    for these paired runs (same instances) it is conservative."""
    p1, p2 = r1["accuracy"], r2["accuracy"]
    (l1, u1), (l2, u2) = r1["ci95"], r2["ci95"]
    d = p1 - p2
    return (d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2), d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2))


def pts(x: float) -> str:
    return f"{100 * x:+.1f}"


def check_lines(rows: list[dict]) -> list[str]:
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    # The checks are for each selection's defaults; other rows are for comparison.
    sparse = {(r["retention"], r["selection"], r["task"]): r for r in rows
              if r["policy"] == "sparse" and default_knobs(r) and default_scoring(r)}
    dense = {(r["policy"], r["task"]): r for r in rows if r["policy"] != "sparse"}
    retentions = sorted({r["retention"] for r in rows if r["policy"] == "sparse"})
    lines = ["## Checks", ""]
    if any(s == "head" for _, s, _ in sparse) and any(s == "uniform" for _, s, _ in sparse):
        lines += [
            "Head vs uniform selection: head - uniform accuracy in points [95% interval of the",
            "difference, Newcombe, unpaired so conservative]; `>=` where head >= uniform.",
            "",
            "| retention | " + " | ".join(tasks) + " |",
            "|---|" + "---|" * len(tasks),
        ]
        worse = []
        for r in retentions:
            cells = []
            for task in tasks:
                head, uni = sparse.get((r, "head", task)), sparse.get((r, "uniform", task))
                if head is None or uni is None:
                    cells.append("-")
                    continue
                low, high = newcombe(head, uni)
                ok = head["accuracy"] >= uni["accuracy"]
                cells.append(f"{'>=' if ok else '<'} {pts(head['accuracy'] - uni['accuracy'])} "
                             f"[{pts(low)}, {pts(high)}]")
                if not ok:
                    worse.append(f"r={r:g} {task}")
            lines.append(f"| {r:g} | " + " | ".join(cells) + " |")
        lines += ["", ("Head >= uniform at every retention and task." if not worse
                       else "Uniform beats head at: " + ", ".join(worse) + "."), ""]
    for base in ("dual", "dual+delay1"):
        ref = dense.get((base, "retrieval"))
        if ref is None:
            continue
        for s in SELECTIONS:
            row = sparse.get((0.5, s, "retrieval"))
            if row is None:
                continue
            low, high = newcombe(row, ref)
            lines.append(f"- retrieval, sparse r=0.5 {s} vs {base}: {row['accuracy']:.1%} vs "
                         f"{ref['accuracy']:.1%}, {pts(row['accuracy'] - ref['accuracy'])} points "
                         f"[{pts(low)}, {pts(high)}]")
    return lines


def write_table(rows: list[dict], out: pathlib.Path, n: int, seed: int) -> None:
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    by_key = {(setting_name(r), r["task"]): r for r in rows}
    lines = [
        f"Exact-match accuracy [95% Wilson interval] per task; n = {n} held-out instances per cell "
        f"(seed {seed}, the same instances in every row).",
        "",
        "| setting | " + " | ".join(tasks) + " |",
        "|---|" + "---|" * len(tasks),
    ]
    for name in dict.fromkeys(setting_name(r) for r in rows):
        cells = []
        for task in tasks:
            r = by_key.get((name, task))
            if r is None:
                cells.append("-")
                continue
            low, high = r["ci95"]
            cells.append(f"{r['accuracy']:.1%} [{low:.1%}, {high:.1%}]")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", *check_lines(rows)]
    (out / "results.md").write_text("\n".join(lines) + "\n")


def plot(rows: list[dict], out: pathlib.Path) -> None:
    _, fig, axes, tasks = task_panels(rows)
    for ax, task in zip(axes, tasks):
        for (selection, scoring), (marker, line, color) in {
            ("head", "weight"): ("o", "-", "tab:blue"), ("uniform", "max"): ("s", "-", "tab:orange"),
            ("head", "max"): ("o", ":", "tab:blue"), ("uniform", "weight"): ("s", ":", "tab:orange"),
            ("head", "mean"): ("o", "--", "tab:purple"), ("uniform", "mean"): ("s", "--", "tab:brown"),
        }.items():
            sel = sorted((r["retention"], r["accuracy"], r["ci95"]) for r in rows
                         if r["task"] == task and r["policy"] == "sparse" and r["selection"] == selection
                         and r.get("scoring") == scoring and default_knobs(r))
            if sel:
                x, y, ci = zip(*sel)
                # Wilson bounds at 0 or 1 can land a rounding error on the wrong side.
                err = [[max(0.0, yy - c[0]) for yy, c in zip(y, ci)], [max(0.0, c[1] - yy) for yy, c in zip(y, ci)]]
                label = f"sparse {selection} ({'mean query' if scoring == 'mean' else scoring})"
                ax.errorbar(x, y, yerr=err, marker=marker, linestyle=line, color=color, capsize=3, label=label,
                            alpha=0.85)
        for policy, style, color in (("exact", "-", "black"), ("dual", "--", "tab:green"),
                                     ("dual+delay1", ":", "tab:red")):
            ref = [r["accuracy"] for r in rows if r["task"] == task and r["policy"] == policy]
            if ref:
                ax.axhline(ref[0], linestyle=style, color=color, alpha=0.7, label=policy)
        ax.set_title(task)
        ax.set_xlabel("retention")
        ax.grid(alpha=0.3)
    save_task_figure(fig, axes, out / "accuracy_vs_retention.png", legend_loc="lower right")


def draw(rows: list[dict], out: pathlib.Path) -> None:
    try:
        plot(rows, out)
    except ModuleNotFoundError as error:  # the table is the result; the plot needs matplotlib
        print(f"accuracy_vs_retention.png not drawn: {error}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_task_arguments(ap, n=500)
    ap.add_argument("--retentions", default=",".join(map(str, RETENTIONS)))
    ap.add_argument("--selections", default=",".join(SELECTIONS))
    ap.add_argument("--scorings", default=",".join(SCORINGS),
                    help="sparse scorings: max, weight, mean, or default (each selection's own)")
    ap.add_argument("--references", default=",".join(DENSE),
                    help=f"the dense settings decoded too ({', '.join(DENSE)}), or none")
    ap.add_argument("--delays", default="1", help="sparse delay_step values (1 is the default)")
    ap.add_argument("--pool-kernels", default="0",
                    help="sparse pool_kernel values (0: each selection's default: head 1 below retention 0.4 "
                         "and 3 from it, uniform 3)")
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results/sparse-quality"))
    ap.add_argument("--from-results", action="store_true",
                    help="decode nothing: rewrite results.md and the plot from OUT/results.json")
    args = ap.parse_args(argv)

    if args.from_results:
        data = json.loads((args.out / "results.json").read_text())
        write_table(data["rows"], args.out, data["n"], data["seed"])
        draw(data["rows"], args.out)
        print((args.out / "results.md").read_text())
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    retentions = [float(r) for r in args.retentions.split(",")]
    points = [(labels, task, xargs_for(options, task))
              for labels, options in settings(retentions, args.selections.split(","), args.scorings.split(","),
                                                 [int(d) for d in args.delays.split(",")],
                                                 [int(k) for k in args.pool_kernels.split(",")],
                                                 [] if args.references == "none" else args.references.split(","))
              for task in args.tasks.split(",")]
    rows = run_points(args.model, points, args.n, args.seed)
    (args.out / "results.json").write_text(
        json.dumps({"model": args.model, "n": args.n, "seed": args.seed, "blocks": BLOCKS, "rows": rows},
                   indent=2) + "\n")
    write_table(rows, args.out, args.n, args.seed)
    draw(rows, args.out)
    print((args.out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
