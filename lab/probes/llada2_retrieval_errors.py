"""What a LLaDA2-format training state answers on retrieval, by kind of error.

    python -m lab.probes.llada2_retrieval_errors --state runs/llada2-run1/state.pt [--n 48]

For retrieval at 2, 3 and 4 pairs and at the curriculum's first raise (6-14 pairs),
held-out instances decoded with LLaDA2.0's rule at threshold 0.95 (the training
tool's own generate, the run's block length), and each answer classed: correct; the
value of the pair just before or after the queried one; the first, last or another
pair's value; two capitals mixing letters of different values ("mixed letters": the
two answer positions do not agree on one pair); anything else.  A model that matched
the key but misread the position would give neighbours; one that never bound the two
letters of a value gives mixed letters.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import random
import re

import torch

from lab.tasks import TEST, Retrieval
from lab.training.batches import Llada2Encoder
from lab.train_llada2 import saved_llada2_model
from lab.training import llada2

SIZES = ((2, 2), (3, 3), (4, 4), (6, 14))


def classify(prompt: str, answer: str, predicted: str) -> str:
    pairs = re.findall(r";([a-z]{2})=([A-Z]{2})", prompt.split("\nvalue of")[0])
    query = prompt.rsplit(";", 1)[1].rstrip("=")
    keys, values = [k for k, _ in pairs], [v for _, v in pairs]
    if predicted == answer:
        return "correct"
    if predicted in values:
        held = values.index(predicted)
        offset = held - keys.index(query)
        if abs(offset) == 1:
            return f"neighbour {offset:+d}"
        if held == 0:
            return "first pair"
        return "last pair" if held == len(values) - 1 else "another pair"
    letters = "".join(values)
    if len(predicted) == 2 and all(c in letters for c in predicted):
        return "mixed letters"
    return "other"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--state", type=pathlib.Path, required=True)
    ap.add_argument("--n", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    state = torch.load(args.state, weights_only=False, map_location="cpu")
    saved = state["args"]
    model, ids, _, _ = saved_llada2_model(state, args.state)
    model.eval()
    encoder = Llada2Encoder(args.state.parent / "tokenizer", ids)
    result = {"step": state["step"], "levels": state.get("curriculum", {}).get("levels"), "sizes": {}}
    for low, high in SIZES:
        rng = random.Random(0)
        instances = [Retrieval(low, high).sample(rng, TEST) for _ in range(args.n)]
        outs = llada2.generate(model, [encoder.prompt(i.prompt) for i in instances], Retrieval.gen_length,
                               mask_id=ids["mask"], eos_id=ids["eos"], block_length=int(saved["block_length"]),
                               threshold=0.95)
        kinds = collections.Counter(classify(i.prompt, i.answer, encoder.decode(o).strip())
                                    for i, o in zip(instances, outs))
        result["sizes"][f"{low}-{high} pairs"] = dict(kinds.most_common())
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
