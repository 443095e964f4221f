"""Whether the in-answer sum is learned faster when its digits line up: states trained on
`working_sum` ("33747+433890=467637") against states trained on `padded_sum` (the same
numbers at one width, "0033747+0433890=0467637"), each read in its own layout.

    python -m lab.probes.llada2_padded_sum --state runs/A/state.pt --padded runs/B/state.pt
        [--n 200] [--out DIR]

One forward per answer, the two numbers written into the canvas and the sum masked, on
two sets of held-out pairs: working_sum's own test split (numbers of 1-5 digits, the
second a multiple of ten half the time) and the partial products of held-out 4x2
multiplications (what multiply's answer writes).  Only the sum's own digits are scored
(a padded sum's leading zeros are free); by place from the right, and whole sums.  Every
state runs on the same pairs in one invocation.  Writes results.json and table.md.
"""

from __future__ import annotations

import argparse
import pathlib
import random
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # report.py

from lab.probes.llada2_sum_from_working import one_forward
from report import print_and_write

PLACES = 6  # places reported one by one; higher ones are pooled into the last


def pairs(n: int) -> dict[str, list[tuple[int, int]]]:
    from lab.tasks import TEST, Multiply, WorkingSum, multiply_factors

    rng = random.Random("padded-sum")
    own = [WorkingSum().sample(rng, TEST).answer for _ in range(n)]
    products = [multiply_factors(Multiply(4, 2, min_digits=2).sample(rng, TEST).prompt) for _ in range(n)]
    return {"working_sum test split": [tuple(int(v) for v in a.split("=")[0].split("+")) for a in own],
            "4x2 partial products": [(a * (b % 10), a * (b // 10) * 10) for a, b in products]}


def written(x: int, y: int, width: int | None) -> tuple[str, str]:
    """The shown working and the hidden sum in a layout (width None: unpadded)."""
    if width is None:
        return f"{x}+{y}=", str(x + y)
    return f"{x:0{width}d}+{y:0{width}d}=", f"{x + y:0{width}d}"


def sum_digits_from_units(hits: list[bool], total: int) -> list[bool]:
    """A hidden sum's hits for its own digits, units first (a padded sum's leading zeros
    left off: the layout gives them away)."""
    return list(reversed(hits[len(hits) - len(str(total)):]))


def measure(state_path: pathlib.Path, width: int | None, sets: dict) -> dict:
    from lab.train_llada2 import saved_llada2_model
    from lab.training.batches import Llada2Encoder
    from lab.training.run_state import load_state

    state = load_state(state_path)
    model, ids, _, _ = saved_llada2_model(state, state_path)
    block = int(state["args"]["block_length"])
    model.eval()
    encoder = Llada2Encoder(state_path.parent / "tokenizer", ids)
    result = {"layout": "unpadded" if width is None else f"padded to {width}", "step": state["step"]}
    for name, items in sets.items():
        right, seen, whole = [0] * PLACES, [0] * PLACES, 0
        for x, y in items:
            shown, hidden = written(x, y, width)
            hits = one_forward(model, encoder, ids, block, "sum the working", shown, hidden)
            own = sum_digits_from_units(hits, x + y)
            for place, hit in enumerate(own):
                right[min(place, PLACES - 1)] += hit
                seen[min(place, PLACES - 1)] += 1
            whole += all(own)
        result[name] = {"digit_accuracy": round(sum(right) / sum(seen), 3), "digits": sum(seen), "whole": whole,
                        "by_place": [round(r / s, 3) if s else None for r, s in zip(right, seen)]}
    return result


def table(result: dict) -> str:
    sets = result["sets"]
    lines = [f"{result['n']} held-out pairs per set, one forward each; sum digits right (leading zeros not "
             "counted), whole sums, and by place from the units (the last place pools the higher ones):", ""]
    head = "| state | layout | step | " + " | ".join(f"{s}: digits | whole | by place" for s in sets) + " |"
    lines += [head, "|" + "---|" * (3 + 3 * len(sets))]
    for r in result["states"]:  # a state may be read in both layouts
        cells = []
        for s in sets:
            m = r[s]
            cells += [str(m["digit_accuracy"]), str(m["whole"]),
                      " ".join("-" if v is None else f"{v:.2f}" for v in m["by_place"])]
        lines.append(f"| `{r['state']}` | {r['layout']} | {r['step']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--state", type=pathlib.Path, action="append", default=[],
                    help="a state trained on working_sum (state.pt, its run's tokenizer/ beside it); repeatable")
    ap.add_argument("--padded", type=pathlib.Path, action="append", default=[],
                    help="a state trained on padded_sum; repeatable")
    ap.add_argument("--width", type=int, default=None, help="the padded layout's width (padded_sum's own if unset)")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args(argv)
    if not args.state and not args.padded:
        ap.error("give at least one --state or --padded")
    if args.n < 1:
        ap.error(f"--n {args.n}: at least one pair")
    import torch

    from lab.tasks import AUX_TASKS

    torch.set_num_threads(args.threads)
    width = args.width or AUX_TASKS["padded_sum"].width
    sets = pairs(args.n)
    states = [{"state": str(p), **measure(p, None, sets)} for p in args.state]
    states += [{"state": str(p), **measure(p, width, sets)} for p in args.padded]
    result = {"n": args.n, "sets": list(sets), "states": states}
    print_and_write(result, table(result), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
