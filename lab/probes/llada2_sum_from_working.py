"""Whether a LLaDA2-format training state adds the partial products its multiply answer
shows, or computes the product from the prompt past them: one forward per answer, the
working written into the canvas and the sum masked.

    python -m lab.probes.llada2_sum_from_working --state runs/A/state.pt [--state runs/B/state.pt ...]
        [--n 100] [--out DIR]

For `n` held-out products with both factors of two digits or more, three canvases:
  right working    the right partial products written, the sum masked: sum digits right
  altered working  the partial products changed (training/altered_working.py), the sum
                   masked: digits of the written partials' sum, and how many whole
                   answers were instead the true product (computed from the prompt)
  addition         the addition task's answer masked, for comparison: the same model
                   adding two numbers the prompt shows
Every state runs on the same instances in one invocation.  Writes results.json and
table.md.
"""

from __future__ import annotations

import argparse
import pathlib
import random
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # report.py

from report import print_and_write


def one_forward(model, encoder, ids, block: int, prompt: str, shown: str, hidden: str) -> list[bool]:
    """Per token of `hidden`, whether the argmax of one forward over the prompt, `shown`
    written into the canvas and `hidden` masked (to the end of its block, as the decoder's
    window), is that token."""
    import torch

    from lab.training.llada2 import block_causal_mask

    p = encoder.prompt(prompt)
    given = encoder.tok.encode(shown, add_special_tokens=False) if shown else []
    target = encoder.tok.encode(hidden, add_special_tokens=False)
    start = len(p) + len(given)
    total = -(-(start + len(target) + 1) // block) * block
    x = torch.full((total,), ids["mask"])
    x[: len(p)] = torch.tensor(p)
    x[len(p): start] = torch.tensor(given, dtype=torch.long)
    pos = torch.arange(total)
    mask = block_causal_mask(pos[None] // block, torch.ones(1, total, dtype=torch.bool))
    with torch.no_grad():
        logits = model.logits(model.hidden_states(x[None], pos[None], mask)[0])
    return (logits[start: start + len(target)].argmax(-1) == torch.tensor(target)).tolist()


def measure(state_path: pathlib.Path, n: int, width: int | None = None) -> dict:
    from lab.tasks import TEST, Addition, Multiply, multiply_answer, multiply_factors
    from lab.train_llada2 import saved_llada2_model
    from lab.training.altered_working import altered_working
    from lab.training.batches import Llada2Encoder
    from lab.training.run_state import load_state

    state = load_state(state_path)
    model, ids, _, _ = saved_llada2_model(state, state_path)
    block = int(state["args"]["block_length"])
    model.eval()
    encoder = Llada2Encoder(state_path.parent / "tokenizer", ids)
    rng = random.Random("sum-from-working")
    products = [Multiply(4, 2, min_digits=2, width=width).sample(rng, TEST) for _ in range(n)]
    sums = [Addition().sample(rng, TEST) for _ in range(n)]
    result = {}
    for name, items in (("right working", products), ("altered working", [altered_working(i, rng) for i in products])):
        digits = whole = from_prompt = 0
        tokens = 0
        for item in items:
            cut = item.answer.rindex("=") + 1
            hits = one_forward(model, encoder, ids, block, item.prompt, item.answer[:cut], item.answer[cut:])
            digits, tokens, whole = digits + sum(hits), tokens + len(hits), whole + all(hits)
            if name == "altered working":
                product = f"{int(multiply_answer(*multiply_factors(item.prompt), working=False)):0{width or 0}d}"
                from_prompt += all(one_forward(model, encoder, ids, block, item.prompt, item.answer[:cut], product))
        result[name] = {"digit_accuracy": round(digits / tokens, 3), "whole": whole}
        if name == "altered working":
            result[name]["true_product_instead"] = from_prompt
    hits = [one_forward(model, encoder, ids, block, item.prompt, "", item.answer) for item in sums]
    result["addition"] = {"digit_accuracy": round(sum(map(sum, hits)) / sum(map(len, hits)), 3),
                          "whole": sum(map(all, hits))}
    return result


def table(result: dict) -> str:
    lines = [f"{result['n']} held-out products (both factors of two digits or more) and {result['n']} additions, "
             "one forward each:", "",
             "| state | right working: sum digits | whole | altered working: written sum digits | whole | "
             "true product instead | addition digits | whole |", "|---|---|---|---|---|---|---|---|"]
    for path, r in result["states"].items():
        right, altered, add = r["right working"], r["altered working"], r["addition"]
        lines.append(f"| `{path}` | {right['digit_accuracy']} | {right['whole']} | {altered['digit_accuracy']} | "
                     f"{altered['whole']} | {altered['true_product_instead']} | {add['digit_accuracy']} | {add['whole']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--state", type=pathlib.Path, action="append", required=True,
                    help="a LLaDA2 training state (state.pt, its run's tokenizer/ beside it); repeat to compare")
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--width", type=int, default=None,
                    help="write the working padded to this width (multiply's layout: 6); plain if unset")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    result = {"n": args.n, "width": args.width, "states": {str(p): measure(p, args.n, args.width) for p in args.state}}
    print_and_write(result, table(result), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
