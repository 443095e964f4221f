"""Forward + backward time of one training MoE layer: the grouped forward against a
gather per expert with index_add (the trainer's MoE before 2026-11-28).

    python -m lab.probes.llada2_moe_backward [--tokens 15000] [--repeats 7] [--threads 2]

The shape is the converted run's (hidden 192, 16 experts of 144, 4 per token, 4 shared;
lab/training-log.md); a retrieval batch of 48 rows in the two-copy layout is about
15,000 tokens.  Both forwards run on the same layer and input, interleaved, in this one
process; the table gives each one's median and the ratio.  Also checks that both give
the same output and input gradient (float32 rounding apart).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from lab.training import llada2

MOE = dict(num_experts=16, experts_per_token=4, n_group=4, topk_group=2, moe_intermediate=144, shared_experts=4,
           dense_layers=1)


def per_expert_index_add(moe: llada2.MoE, x: torch.Tensor) -> torch.Tensor:
    chosen, weights = moe.route(x)
    out = torch.zeros_like(x)
    for e, expert in enumerate(moe.experts):
        rows, slot = (chosen == e).nonzero(as_tuple=True)
        if len(rows):
            out = out.index_add(0, rows, weights[rows, slot, None].to(x.dtype) * expert(x[rows]))
    return out + moe.shared_experts(x)


def timed(forward, x: torch.Tensor, upstream: torch.Tensor) -> tuple[float, torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_()
    start = time.perf_counter()
    out = forward(x)
    (out * upstream).sum().backward()
    return time.perf_counter() - start, out.detach(), x.grad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=15000)
    ap.add_argument("--hidden", type=int, default=192)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    moe = llada2.MoE(args.hidden, MOE)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.05)
    moe.train()
    x = torch.randn(args.tokens, args.hidden)
    upstream = torch.randn(args.tokens, args.hidden)
    sides = {"per-expert index_add": lambda t: per_expert_index_add(moe, t), "grouped": moe}
    times: dict[str, list[float]] = {name: [] for name in sides}
    results = {}
    for _ in range(args.repeats + 1):  # the first round warms up
        for name, forward in sides.items():
            moe.zero_grad(set_to_none=True)
            seconds, out, grad = timed(forward, x, upstream)
            times[name].append(seconds)
            results[name] = (out, grad)
    (out_a, grad_a), (out_b, grad_b) = results.values()
    torch.testing.assert_close(out_b, out_a, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grad_b, grad_a, rtol=1e-4, atol=1e-5)
    medians = {name: statistics.median(t[1:]) for name, t in times.items()}
    base = medians["per-expert index_add"]
    print(f"| MoE layer, {args.tokens} tokens, {args.threads} threads | median s (fwd+bwd) | vs per-expert |")
    print("|---|---|---|")
    for name, m in medians.items():
        print(f"| {name} | {m:.3f} | {base / m:.2f}x |")
    print(json.dumps({"tokens": args.tokens, "threads": args.threads, "median_s": medians}))


if __name__ == "__main__":
    main()
