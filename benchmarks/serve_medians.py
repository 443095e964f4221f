"""The median of repeated `serve_sweep.py` runs, per (workload, rate, configuration).

    python benchmarks/serve_medians.py --baseline l20 RUN1/results.json RUN2/results.json RUN3/results.json \
        --out benchmarks/results/NAME/medians.md

Timings on a shared 2-core CPU swing between runs; one run's ratio can be another's
noise.  The table lists every run's committed tokens/s beside their median, the median's
ratio to the baseline configuration's median at the same point, and the median mean
latency.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics


def point_runs(runs: list[dict]) -> dict[tuple[str, float, str], list[dict]]:
    """Each (workload, rate, configuration)'s rows, one per run, in run order."""
    points: dict[tuple[str, float, str], list[dict]] = {}
    for run in runs:
        for config, rows in run["results"].items():
            for row in rows:
                points.setdefault((row["workload"], row["rate"], config), []).append(row)
    return points


def medians_table(runs: list[dict], baseline: str) -> str:
    points = point_runs(runs)
    lines = [f"| workload | rate | config | committed tok/s ({len(runs)} runs) | median | x {baseline} (median) "
             "| mean latency s (median) |", "|---|---|---|---|---|---|---|"]
    for (workload, rate, config), rows in sorted(points.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        if len(rows) != len(runs):
            raise ValueError(f"{workload} at {rate}/s under {config}: {len(rows)} of {len(runs)} runs have it")
        tok_s = [r["committed_tok_s"] for r in rows]
        median = statistics.median(tok_s)
        base = statistics.median(r["committed_tok_s"] for r in points[(workload, rate, baseline)])
        latency = statistics.median(r["mean_e2el_ms"] for r in rows) / 1000
        lines.append(f"| {workload} | {rate:g} | {config} | {' / '.join(f'{t:.0f}' for t in tok_s)} | {median:.0f} "
                     f"| {median / base:.2f} | {latency:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=pathlib.Path, help="serve_sweep.py results.json files")
    ap.add_argument("--baseline", required=True, help="the configuration ratios are taken against")
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args(argv)
    table = medians_table([json.loads(p.read_text()) for p in args.runs], args.baseline)
    print(table, end="")
    if args.out:
        args.out.write_text(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
