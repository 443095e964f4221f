"""Which step of a multiply answer's written working a LLaDA2-format task model gets
wrong, through the plugin: the partial products (a by the multiplier's units digit, a by
its tens digit times ten), or the sum of the partial products the answer itself wrote.

    python -m lab.probes.llada2_multiply_working --model DIR [--n 150] [--seed 0] [--out DIR]

`n` held-out products with both factors of two digits or more (every one writes its
working, `tasks.multiply_answer`), at the model's default decoding.  Each answer is
checked step by step: a model that writes both partial products right and then a wrong
sum has the products and not the addition over its own answer; one whose written sum
matches what it wrote, right or not, adds and miscomputes a product.
Writes results.json and table.md.
"""

from __future__ import annotations

import argparse
import pathlib
import random
import re
import sys
from collections import Counter

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # report.py

from report import print_and_write

from lab.tasks import TEST, Instance, Multiply, multiply_factors, score

CHECKS = ("written as p0+p1=product", "p0 right", "p1 right", "both partial products right",
          "product = p0 + p1 as written", "product right", "whole answer right")
WORKING = re.compile(r"(\d+)\+(\d+)=(\d+)")


def checks(instance: Instance, predicted: str) -> set[str]:
    """The CHECKS `predicted` passes (none but the last two apply without the form)."""
    a, b = multiply_factors(instance.prompt)
    text = predicted.strip()
    match = WORKING.fullmatch(text)
    if match is None:
        return {"product right"} if text == str(a * b) else set()
    passed = {"whole answer right"} if score(instance, text) else set()  # the working in either layout
    p0, p1, product = (int(g) for g in match.groups())
    right0, right1 = p0 == a * (b % 10), p1 == a * (b // 10) * 10
    flags = {"written as p0+p1=product": True, "p0 right": right0, "p1 right": right1,
             "both partial products right": right0 and right1, "product = p0 + p1 as written": product == p0 + p1,
             "product right": product == a * b}
    return passed | {name for name, ok in flags.items() if ok}


def products(n: int, seed: int) -> list[Instance]:
    task = Multiply(4, 2, min_digits=2)
    rng = random.Random(f"working-{seed}")
    return [task.sample(rng, TEST) for _ in range(n)]


def table(result: dict) -> str:
    lines = [f"{result['n']} held-out products, both factors of two digits or more:", "",
             "| check | answers |", "|---|---|"]
    lines += [f"| {name} | {result['passed'][name]} |" for name in CHECKS]
    lines += ["", "| prompt | answer | written |", "|---|---|---|"]
    lines += [f"| `{p}` | `{a}` | `{w}` |" for p, a, w in result["examples"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--n", type=int, default=150)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args(argv)
    from lab.eval import OFFLINE_ENGINE, OfflineRunner

    runner = OfflineRunner(args.model, OFFLINE_ENGINE)
    items = products(args.n, args.seed)
    texts, _, _ = runner.run(items, runner.default_canvas(Multiply(), {}), {})
    passed = Counter(name for item, text in zip(items, texts) for name in checks(item, text))
    result = {"model": args.model, "seed": args.seed, "n": len(items),
              "passed": {name: passed[name] for name in CHECKS},
              "examples": [[i.prompt, i.answer, t.strip()] for i, t in list(zip(items, texts))[:12]]}
    print_and_write(result, table(result), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
