"""What one LM-head chunk sends across tensor-parallel ranks: the vocabulary-parallel
reduce (decoding/vocab.py) against gathering whole logits rows (vLLM's LogitsProcessor).

    python benchmarks/vocab_parallel_traffic.py --out benchmarks/results/vocab-parallel

Each decoding case of tests/unit/test_vocab_parallel.py runs its rule's reduce over a
chunk of --rows rows of a LLaDA-8B-sized vocabulary (126,464), split over --world
ranks simulated as threads (tests/vocab_shards.py), and counts the numbers each rank
sends.  A gathered head sends its shard of every row: vocabulary / world numbers per
row per rank.  Counts, not timings: they do not depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import sys

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the test suite's rule cases and simulated ranks

from tests.unit import test_vocab_parallel as cases  # noqa: E402
from tests.vocab_shards import Exchange  # noqa: E402
LLADA_8B_VOCAB = 126_464


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, default=HERE / "results" / "vocab-parallel")
    ap.add_argument("--vocab", type=int, default=LLADA_8B_VOCAB)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()
    cases.V = args.vocab
    torch.set_num_threads(1)
    rows = []
    for name, kind, specs in cases.CASES:
        requests, _, _, _ = cases.draw_case(kind, specs, random.Random(name))
        slots = torch.arange(args.rows) % len(requests)
        positions = torch.arange(args.rows) % 8
        logits = torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(0)) * 3
        exchange = Exchange(args.world)
        cases.sharded_reduce(kind, requests, slots, positions, logits, args.world, exchange)
        ours = exchange.elements / args.rows
        gathered = args.vocab / args.world
        rows.append({"case": name, "gathers": exchange.calls, "numbers_per_row": ours,
                     "gathered_head_numbers_per_row": gathered, "ratio": gathered / ours})
        print(f"{name}: {exchange.calls} gathers, {ours:.0f} numbers per row per rank "
              f"(gathered head: {gathered:.0f}, {gathered / ours:.0f}x)", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {"vocab": args.vocab, "rows": args.rows, "world": args.world, "cases": rows}
    (args.out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    table = (f"One LM-head chunk of {args.rows} rows, vocabulary {args.vocab:,}, {args.world} ranks: numbers "
             "each rank sends per row (float64 values and ids; the gathered head sends float32 or bf16 "
             "logits).\n\n| case | all-gathers | vocabulary-parallel | gathered head | fewer |\n|---|---|---|---|---|\n"
             + "".join(f"| {r['case']} | {r['gathers']} | {r['numbers_per_row']:.0f} | "
                       f"{r['gathered_head_numbers_per_row']:,.0f} | {r['ratio']:,.0f}x |\n" for r in rows))
    (args.out / "table.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
