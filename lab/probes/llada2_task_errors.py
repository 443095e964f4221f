"""What a LLaDA2-format task model answers on sort and multiply, by kind of error and by
instance size, through the plugin: at the eval's default decoding, and with about one
token committed a step (threshold 1.0: no token clears it, so each step commits its
single most confident one).

    python -m lab.probes.llada2_task_errors --model DIR [--n 200] [--out DIR]

If one token a step fixes most errors, they come from committing tokens together that
depend on each other (the decoding rule's doing); if it fixes few, from the model.

Sort answers are classed: correct; not a list of numbers; a number the input does not
hold (a number copied with a digit from elsewhere), and among those, one that differs
from the right number at its place in one digit; numbers dropped or added; the right
count with an input number repeated in place of another; the right numbers in the
wrong order.  Multiply answers, by the product they end with: correct; the product right and the
written partial products (a two-digit multiplier's working) not; the product of the wrong
length (or not a number); or, with the right length, by the lowest wrong digit (0 = units): the units digit is a*b's units digit
alone, each digit above it needs the carries from below, so a model that multiplies
digit by digit but loses carries goes wrong above the units first.
Writes results.json and table.md.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
from collections import Counter

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # report.py

from report import print_and_write

from lab.eval import OFFLINE_ENGINE, OfflineRunner, instances
from lab.tasks import ALL_TASKS, Instance, multiply_product, score

SORT_CLASSES = (
    "correct",
    "not a list of numbers",
    "a number not in the input, one digit off",
    "a number not in the input, other",
    "numbers dropped",
    "numbers added",
    "an input number repeated in place of another",
    "right numbers, wrong order",
)
MULTIPLY_CLASSES = ("correct", "product right, working wrong", "wrong length or not a number", "units digit wrong",
                    "units right, tens wrong", "units and tens right, higher digit wrong")
DECODINGS = {"default": {}, "one token a step": {"threshold": 1.0}}


def classify_sort(instance: Instance, predicted: str) -> str:
    numbers = instance.prompt.split()[1:]
    want = instance.answer.split()
    got = predicted.split()
    if got == want:
        return "correct"
    if not got or not all(g.isdigit() for g in got):
        return "not a list of numbers"
    foreign = [i for i, g in enumerate(got) if g not in numbers]
    if foreign:
        first = foreign[0]
        right = want[first] if first < len(want) else ""
        one_off = len(right) == len(got[first]) and sum(a != b for a, b in zip(right, got[first])) == 1
        return "a number not in the input, " + ("one digit off" if one_off else "other")
    if len(got) < len(want):
        return "numbers dropped"
    if len(got) > len(want):
        return "numbers added"
    if sorted(got, key=int) == want:
        return "right numbers, wrong order"
    return "an input number repeated in place of another"


def classify_multiply(instance: Instance, predicted: str) -> str:
    """By the product the answer ends with; a two-digit multiplier's written partial
    products (the working) are checked only when the product is right, and a right
    product written alone is correct (`tasks.accepted_answers`)."""
    if score(instance, predicted):
        return "correct"
    want, got = multiply_product(instance.answer), multiply_product(predicted.strip())
    if got == want:
        return "product right, working wrong"
    if len(got) != len(want) or not got.isdigit():
        return "wrong length or not a number"
    lowest = next(i for i in range(len(want)) if got[-1 - i] != want[-1 - i])
    return MULTIPLY_CLASSES[3 + min(lowest, 2)]


def sort_size(instance: Instance) -> str:
    return f"{len(instance.prompt.split()) - 1} numbers"


def multiply_size(instance: Instance) -> str:
    a, b = instance.prompt.removeprefix("mul ").rstrip("=").split("*")
    return f"{len(a)}x{len(b)} digits"


TASKS = {"sort": (SORT_CLASSES, classify_sort, sort_size),
         "multiply": (MULTIPLY_CLASSES, classify_multiply, multiply_size)}


def tally(task: str, items: list[Instance], texts: list[str]) -> dict:
    classes, classify, size = TASKS[task]
    overall: Counter = Counter()
    by_size: dict[str, Counter] = {}
    for item, text in zip(items, texts):
        kind = classify(item, text)
        overall[kind] += 1
        by_size.setdefault(size(item), Counter())[kind] += 1
    return {"n": len(items), "classes": {k: overall[k] for k in classes},
            "correct_by_size": {s: [c["correct"], sum(c.values())]
                                for s, c in sorted(by_size.items(), key=size_order)}}


def size_order(item: tuple[str, Counter]) -> list[int]:
    """"4 numbers" before "10 numbers"; "2x1 digits" before "2x2 digits"."""
    return [int(part) for part in re.findall(r"\d+", item[0])]


def compare(first: list[bool], second: list[bool]) -> dict:
    return {"fixed": sum(not a and b for a, b in zip(first, second)),
            "broken": sum(a and not b for a, b in zip(first, second))}


def table(result: dict) -> str:
    lines = []
    for task, runs in result["tasks"].items():
        names = list(runs["decodings"])
        lines += [f"## {task}", "", "| class | " + " | ".join(f"{d} (n = {runs['decodings'][d]['n']})"
                                                                 for d in names) + " |",
                  "|---|" + "---|" * len(names)]
        for kind in TASKS[task][0]:
            lines.append(f"| {kind} | " + " | ".join(str(runs["decodings"][d]["classes"][kind]) for d in names) + " |")
        lines.append("| forwards per token | " + " | ".join(f"{runs['decodings'][d]['forwards_per_token']:.2f}"
                                                            for d in names) + " |")
        lines += ["", "| size | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for size in runs["decodings"][names[0]]["correct_by_size"]:
            cells = [runs["decodings"][d]["correct_by_size"].get(size, [0, 0]) for d in names]
            lines.append(f"| {size} | " + " | ".join(f"{c}/{t}" for c, t in cells) + " |")
        change = runs["one token a step against default"]
        lines += ["", f"One token a step against the default: {change['fixed']} wrong answers right, "
                  f"{change['broken']} right answers wrong.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0, help="the eval's instances for the same seed")
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args(argv)
    runner = OfflineRunner(args.model, OFFLINE_ENGINE)
    result = {"model": args.model, "seed": args.seed, "tasks": {}}
    for name in TASKS:
        task = ALL_TASKS[name]
        items = instances(task, args.n, args.seed)
        runs, right = {}, {}
        for decoding, xargs in DECODINGS.items():
            texts, tokens, steps = runner.run(items, runner.default_canvas(task, xargs), xargs)
            runs[decoding] = {"xargs": xargs, **tally(name, items, texts),
                              "forwards_per_token": steps / max(tokens, 1)}
            right[decoding] = [TASKS[name][1](i, t) == "correct" for i, t in zip(items, texts)]
        result["tasks"][name] = {"decodings": runs,
                                 "one token a step against default": compare(right["default"],
                                                                             right["one token a step"])}
    print_and_write(result, table(result), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
