"""Two-digit multipliers on a LLaDA2-format task model, through the plugin: are they
learned on the training split and not the test split (memorised), on neither, or on
both; and when the tens digit of a 2x2 product is wrong, what the model wrote there.

    python -m lab.probes.llada2_multiply_products --model DIR [--n 80] [--out DIR]

For each multiplicand of 2, 3 and 4 digits under a multiplier of 10-99, `n` instances
of each split (the tasks' hash decides an instance's split, as for every task), at the
model's default decoding.  The tens digit of a*b sums two partial products and a carry,
a0*b1 + a1*b0 + carry(a0*b0) (mod 10; a0 the units digit of a); a wrong tens digit is
checked against the value each partial sum would give (one product or the carry left
out) and against the right digit +-1, +-2.  If one of those explains most wrong digits,
the model computes that part and misses the rest; if each explains about one in nine
(a wrong digit has nine values), the model has not found the sum.
Writes results.json and table.md.
"""

from __future__ import annotations

import argparse
import pathlib
import random
import sys
from collections import Counter

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # report.py

from report import print_and_write

from lab.eval import OFFLINE_ENGINE, OfflineRunner
from lab.tasks import TEST, TRAIN, Instance, Multiply, multiply_product, score

MULTIPLICAND_DIGITS = (2, 3, 4)
TENS_EXPLANATIONS = ("carry left out", "a0*b1 left out", "a1*b0 left out", "right +1", "right -1", "right +2",
                     "right -2")


def products(digits: int, n: int, split: str, seed: int) -> list[Instance]:
    """`n` products of a `digits`-digit multiplicand and a two-digit multiplier, of `split`."""
    task = Multiply(digits, 2, min_digits=digits)
    rng = random.Random(f"{seed}-{digits}-{split}")
    return [task.sample(rng, split) for _ in range(n)]


def factors(instance: Instance) -> tuple[int, int]:
    a, b = instance.prompt.removeprefix("mul ").removesuffix("=").split("*")
    return int(a), int(b)


def tens_explanations(instance: Instance, predicted: str) -> list[str] | None:
    """The explanations that give the tens digit of the product `predicted` ends with,
    or None when that product is not of the right length, or its tens digit is right."""
    got, want = multiply_product(predicted.strip()), multiply_product(instance.answer)
    if len(got) != len(want) or len(want) < 2 or not got.isdigit() or got[-2] == want[-2]:
        return None
    a, b = factors(instance)
    a0, a1, b0, b1 = a % 10, a // 10 % 10, b % 10, b // 10 % 10
    carry = a0 * b0 // 10
    right = int(want[-2])
    values = dict(zip(TENS_EXPLANATIONS, (a0 * b1 + a1 * b0, a1 * b0 + carry, a0 * b1 + carry,
                                         right + 1, right - 1, right + 2, right - 2)))
    return [name for name, value in values.items() if value % 10 == int(got[-2])]


def table(result: dict) -> str:
    lines = ["| multiplicand x multiplier | train split | test split |", "|---|---|---|"]
    for size, cells in result["right"].items():
        lines.append(f"| {size} | " + " | ".join(f"{cells[s][0]}/{cells[s][1]}" for s in (TRAIN, TEST)) + " |")
    tens = result["2x2 wrong tens"]
    lines += ["", f"2x2, both splits: {tens['wrong']} answers of the right length with the tens digit wrong; "
              "the wrong digit equals (one in nine by chance):", "",
              "| explanation | answers | share |", "|---|---|---|"]
    for name in TENS_EXPLANATIONS:
        share = tens["explained"][name] / tens["wrong"] if tens["wrong"] else 0.0
        lines.append(f"| {name} | {tens['explained'][name]} | {share:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--n", type=int, default=80, help="instances per size and split")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args(argv)
    runner = OfflineRunner(args.model, OFFLINE_ENGINE)
    canvas = runner.default_canvas(Multiply(), {})
    result = {"model": args.model, "seed": args.seed, "n": args.n, "right": {},
              "2x2 wrong tens": {"wrong": 0, "explained": dict.fromkeys(TENS_EXPLANATIONS, 0)}}
    tens = Counter()
    for digits in MULTIPLICAND_DIGITS:
        size = f"{digits}x2"
        result["right"][size] = {}
        for split in (TRAIN, TEST):
            items = products(digits, args.n, split, args.seed)
            texts, _, _ = runner.run(items, canvas, {})
            result["right"][size][split] = [sum(score(i, t) for i, t in zip(items, texts)), len(items)]
            if digits == 2:
                for item, text in zip(items, texts):
                    explained = tens_explanations(item, text)
                    if explained is not None:
                        tens["wrong"] += 1
                        tens.update(explained)
    result["2x2 wrong tens"] = {"wrong": tens["wrong"], "explained": {k: tens[k] for k in TENS_EXPLANATIONS}}
    print_and_write(result, table(result), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
