"""Whether a LLaDA2-format training state has formed retrieval's lookup, read from
its attention rather than its answers.

    python -m lab.probes.llada2_attention_probe --state runs/llada2-run2/state.pt [--n 32] [--out shares.json]

Retrieval is answered by matching the queried key against the keys of the prompt and
reading the value after the match.  For held-out retrieval prompts at several pair
counts, a forward over the prompt and a fully masked canvas (the decoder's first step,
block-causal as it runs) gives each head's attention; from three sources, the queried
key token at the prompt's end and the first two answer positions, this reports which
share of the attention a head gives the pairs' keys (or values) goes to the queried
pair's.  A head that matches by content gives its pair nearly all of it; one that does
not gives each pair about the same (chance: 1 / pairs).  Answers alone cannot tell a
lookup that is forming from one that is absent until accuracy moves.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import re

import torch

from lab.tasks import TEST, Retrieval
from lab.training.batches import Llada2Encoder
from lab.train_llada2 import saved_llada2_model
from lab.training import llada2

PAIR_COUNTS = (2, 4, 8, 40)
KEY = re.compile(r";[a-z]{2}=")


def layout(encoder: Llada2Encoder, prompt: str, block: int) -> dict:
    """Token ids of prompt and masked canvas, and where the keys, values and query sit."""
    ids = encoder.prompt(prompt)
    pieces = [encoder.tok.decode([t]) for t in ids]
    keys = [i for i, p in enumerate(pieces) if KEY.fullmatch(p)]
    query = keys.pop()  # the last key token is the question's
    match = next(i for i, k in enumerate(keys) if pieces[k] == pieces[query])
    end = -(-(len(ids) + Retrieval.gen_length) // block) * block
    return {"ids": ids + [encoder.ids["mask"]] * (end - len(ids)), "keys": keys, "match": match,
            "query": query, "answer": len(ids)}


def shares(weights: torch.Tensor, sources: dict[str, int], keys: list[int], match: int) -> dict[str, torch.Tensor]:
    """Per head [H]: of the attention a source gives the keys (values), the share on the
    queried pair's key (its two value tokens)."""
    key_pos = torch.tensor(keys)
    value_pos = torch.stack([key_pos + 1, key_pos + 2], 1)
    out = {}
    for name, src in sources.items():
        row = weights[:, src]  # [H, T]
        on_keys = row[:, key_pos]
        on_values = row[:, value_pos].sum(-1)
        out[f"{name}->key"] = on_keys[:, match] / on_keys.sum(-1).clamp_min(1e-12)
        out[f"{name}->value"] = on_values[:, match] / on_values.sum(-1).clamp_min(1e-12)
    return out


@torch.no_grad()
def probe(model, encoder: Llada2Encoder, pairs: int, n: int, block: int) -> dict:
    captured = {}
    hooks = [layer.attention.register_forward_pre_hook(
        lambda mod, args, i=i: captured.__setitem__(i, args)) for i, layer in enumerate(model.model.layers)]
    rng = random.Random(0)
    totals: dict[tuple[int, str], torch.Tensor] = {}
    try:
        for _ in range(n):
            case = layout(encoder, Retrieval(pairs, pairs).sample(rng, TEST).prompt, block)
            ids = torch.tensor(case["ids"])[None]
            positions = torch.arange(ids.shape[1])[None]
            mask = llada2.block_causal_mask(positions // block, torch.ones_like(ids, dtype=torch.bool))
            model.hidden_states(ids, positions, mask)
            sources = {"query": case["query"], "answer 1": case["answer"], "answer 2": case["answer"] + 1}
            for i, layer in enumerate(model.model.layers):
                weights = layer.attention.weights(*captured[i])[0]
                for name, value in shares(weights, sources, case["keys"], case["match"]).items():
                    totals[(i, name)] = totals.get((i, name), 0) + value
    finally:
        for hook in hooks:
            hook.remove()
    return {f"layer {i} {name}": [round(float(v) / n, 3) for v in total] for (i, name), total in totals.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--state", type=pathlib.Path, required=True)
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--pairs", default=",".join(map(str, PAIR_COUNTS)))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=pathlib.Path, help="the per-head shares as JSON")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    state = torch.load(args.state, weights_only=False, map_location="cpu")
    model, ids, _, _ = saved_llada2_model(state, args.state)
    model.eval()
    encoder = Llada2Encoder(args.state.parent / "tokenizer", ids)
    block = int(state["args"]["block_length"])
    result = {"step": state["step"], "pairs": {}}
    for pairs in (int(p) for p in args.pairs.split(",")):
        table = probe(model, encoder, pairs, args.n, block)
        result["pairs"][pairs] = table
        ranked = sorted(((share, f"{name} head {h}") for name, row in table.items() for h, share in enumerate(row)),
                        reverse=True)
        print(f"{pairs} pairs (chance {1 / pairs:.3f}): " + ", ".join(f"{s:.3f} {where}" for s, where in ranked[:3]),
              flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
