"""KV tile size, warps and stages of the Triton paged-attention kernel, swept on a GPU
(the query tile stays at its default: 32 rows for 32-query blocks).

    python benchmarks/triton_tile_sweep.py --out /tmp/tile-sweep

Shapes of the LLaDA-8B Reuse step (32 heads x 128, bf16, 32-query blocks, 16-slot
pages): the step_bench sparse/dense cases (16 requests over 1,252 / 4,096 / 4,938 /
16,384 positions) and one request over 512.  Each configuration's output is checked
against the default configuration's before it is timed.  Reported per shape: the
default's time, the best configuration and its time, and an SDPA over contiguous K/V of
the same lengths (what the kernel would cost without pages).
"""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from vllm_dllm.attention.triton_paged import _wide_kv_tile, default_block_sizes, paged_attention_triton  # noqa: E402

HEADS, HEAD_DIM, QUERIES, PAGE = 32, 128, 32, 16
SHAPES = [(1, 512), (16, 1252), (16, 4096), (16, 4938), (16, 16384)]


def inputs(requests: int, seq_len: int, device, dtype=torch.bfloat16):
    gen = torch.Generator(device=device).manual_seed(0)
    pages = -(-seq_len // PAGE)
    kv = torch.randn(requests * pages + 1, PAGE, 2, HEADS, HEAD_DIM, generator=gen, device=device, dtype=dtype)
    # Pages shuffled, as a pool's free list leaves them.
    table = (torch.randperm(requests * pages, generator=gen, device=device) + 1).view(requests, pages).int()
    q = torch.randn(requests * QUERIES, HEADS, HEAD_DIM, generator=gen, device=device, dtype=dtype)
    args = dict(
        q=q, kv_cache=kv, block_table=table,
        query_start_loc=torch.arange(0, requests * QUERIES + 1, QUERIES, device=device, dtype=torch.int32),
        seq_lens=torch.full((requests,), seq_len, device=device, dtype=torch.int32),
        kv_start=torch.zeros(requests, device=device, dtype=torch.int32),
        max_query_len=QUERIES, scale=HEAD_DIM**-0.5,
    )
    keys, values = (torch.randn(requests, HEADS, seq_len, HEAD_DIM, generator=gen, device=device, dtype=dtype)
                    for _ in range(2))
    grid = q.view(requests, QUERIES, HEADS, HEAD_DIM).transpose(1, 2)
    return args, lambda: F.scaled_dot_product_attention(grid, keys, values)


def main() -> None:
    import triton.testing

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    configs = list(itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3, 4)))  # block_n, warps, stages
    rows = []
    for requests, seq_len in SHAPES:
        kernel_args, ideal = inputs(requests, seq_len, device)
        reference = paged_attention_triton(**kernel_args)
        default_m, default_n, default_stages = default_block_sizes(HEAD_DIM, QUERIES, 2, _wide_kv_tile(device))
        timings = {}
        for block_n, warps, stages in configs:
            def run(block_n=block_n, warps=warps, stages=stages):
                return paged_attention_triton(**kernel_args, block_n=block_n, num_warps=warps, num_stages=stages)
            try:
                out = run()
            except Exception as exc:  # out of shared memory for this tile
                timings[f"n{block_n}-w{warps}-s{stages}"] = f"failed: {type(exc).__name__}"
                continue
            err = (out.float() - reference.float()).abs().max().item()
            if err > 2e-2:
                timings[f"n{block_n}-w{warps}-s{stages}"] = f"wrong: max abs error {err:.3g}"
                continue
            timings[f"n{block_n}-w{warps}-s{stages}"] = triton.testing.do_bench(run, warmup=25, rep=100)
        default_ms = triton.testing.do_bench(lambda: paged_attention_triton(**kernel_args), warmup=25, rep=100)
        measured = {k: v for k, v in timings.items() if isinstance(v, float)}
        if not measured:
            raise RuntimeError(f"no configuration ran for {requests} x {seq_len}: {timings}")
        best = min(measured, key=measured.get)
        row = {"requests": requests, "seq_len": seq_len, "default": f"m{default_m}-n{default_n}-w4-s{default_stages or 'triton'}",
               "default_ms": round(default_ms, 4), "best": best, "best_ms": round(measured[best], 4),
               "sdpa_ms": round(triton.testing.do_bench(ideal, warmup=25, rep=100), 4), "all": timings}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "all"}), flush=True)
        kernel_args = ideal = reference = None
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
