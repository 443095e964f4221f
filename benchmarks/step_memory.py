"""A step's activation peak against its query tokens, with and without the FFN run in
chunks of tokens (vllm_dllm/models/token_chunks.py), on LLaDA-8B's or LLaDA-MoE's widths.

    python benchmarks/step_memory.py --out benchmarks/results/step-memory/NAME
        [--shape llada-8b|llada-moe] [--tokens 512 1024 2048 4096] [--max-num-logits 128 1024]
        [--layers 1] [--time-tokens 2048]

The model is the plugin's LLaDA (or LLaDA-MoE) on vLLM's layers (`vllm.LLM` in this
process, random weights: `load_format="dummy"`), bfloat16, with `--layers` layers (a
step's transient peak is one layer's, whatever the depth) of the shape's widths:
llada-8b, LLaDA-8B's (hidden 4096, 32 heads, FFN 12,288, vocabulary 126,464);
llada-moe, LLaDA-MoE-7B's as reported (hidden 2048, 16 heads, 64 routed experts, top 8)
with an expert width of 1,024 assumed (its config.json was not available), every layer
routed, and a vocabulary of 157,184 (the tokenizer's ids lie within it).  Each point is one Refresh forward over a
sequence of T query tokens (the largest phase a step has), its peak of live tensor
bytes above what was live before it, from torch.profiler's allocation events (so the
allocator's caching does not enter).  The LM head's tile is reported beside it:
`max_num_logits` rows of float32 logits, which the LM head never exceeds and which
bounds the FFN's chunks.  Both peaks grow linearly in T past the tile; the largest
Refresh a fixed activation budget allows, chunked and whole, comes from the measured
points (past the longest, along the slope of the two longest).  `--time-tokens`: the
forward's wall time at that T, chunked and whole, interleaved, medians.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

SHAPES = {
    "llada-8b": ("llada", dict(d_model=4096, n_heads=32, n_kv_heads=32, mlp_hidden_size=12288), "n_layers",
                 "max_sequence_length"),
    "llada-moe": ("llada-moe", dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=16,
                                    num_experts=64, num_experts_per_tok=8, expert_intermediate_size=1024,
                                    shared_expert_intermediate_size=None, dense_intermediate_size=8192,
                                    vocab_size=157184),
                  "num_hidden_layers", "max_position_embeddings"),
}


def make_model_dir(root: pathlib.Path, shape: str, layers: int, max_len: int) -> tuple[pathlib.Path, dict]:
    """A checkpoint folder of the shape's widths whose weights vLLM draws at load (its
    config and real tokenizer; the tiny weights written beside them are not read), and
    its config."""
    from vllm_dllm.tools.make_tiny import make_tiny

    arch, widths, layers_key, length_key = SHAPES[shape]
    # LLaDA-MoE's tiny writer has the small tokenizer only: its vocabulary is widened in the config.
    out = make_tiny(arch, root / f"{shape}-shape", vocab="small" if arch == "llada-moe" else "real", layers=1,
                    hidden=64, heads=2,
                    intermediate=64, max_len=max_len, dtype="bfloat16")
    config = json.loads((out / "config.json").read_text())
    config.update(widths, **{layers_key: layers, length_key: max_len})
    if arch == "llada-moe":
        config["moe_layer_freq"] = [1] * layers
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out, config


def peak_bytes(fn) -> int:
    """Peak of live tensor bytes while `fn` runs, above those live before: allocations
    at their op's start, frees where the profiler records them."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    changes = sorted(
        (e.time_range.start, e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage)
        for e in prof.events()
    )
    live = peak = 0
    for _, change in changes:
        live += change
        peak = max(peak, live)
    return peak


def refresh_forward(worker, tokens: int, chunked: bool, measure: str, vocab: int):
    """In the worker: one Refresh of a `tokens`-long sequence through the model, the
    FFN chunked by the LM-head tile or whole; its peak bytes or its wall seconds."""
    import numpy as np
    import torch

    from vllm_dllm.attention.metadata import attention_metadata
    from vllm_dllm.engine.step_inputs import SequenceLayout, build_step_inputs

    runner = worker.model_runner
    engine, model = runner.engine, runner.model
    mlps = [m for m in model.modules() if hasattr(m, "limit_activation")]
    saved = [m.max_rows for m in mlps]
    if not chunked:
        for m in mlps:
            m.max_rows = None
    one = np.array([tokens], dtype=np.int64)
    zero = np.zeros(1, dtype=np.int64)
    layout = SequenceLayout(slot=zero, twin=zero.astype(bool), query_start=zero, num_queries=one, seq_len=one,
                            kv_start=zero)
    inputs = build_step_inputs(layout, prompt_tokens=engine.prompt_tokens, prompt_len=engine.prompt_len,
                               canvas=engine.decode.canvas, block_table=engine.block_table[:1].clone(),
                               block_size=engine.block_size, mask_id=engine.ids.mask, backend=engine.backend)
    ids = torch.randint(0, vocab, (tokens,))

    @torch.inference_mode()
    def forward():
        with attention_metadata(inputs.metadata), engine.model_context(tokens):
            return engine.model(ids, inputs.positions)

    try:
        if measure == "peak":
            return peak_bytes(forward), [m.max_rows for m in mlps][0]
        start = time.perf_counter()
        forward()
        return time.perf_counter() - start, None
    finally:
        for m, rows in zip(mlps, saved):
            m.max_rows = rows


def fit(points: list[tuple[int, int]]) -> tuple[float, float]:
    """(intercept, bytes per token) through the two longest Refreshes: chunking starts
    only past the tile, so the shorter ones lie on the unchunked line."""
    (x0, y0), (x1, y1) = sorted(points)[-2:]
    slope = (y1 - y0) / (x1 - x0)
    return y1 - slope * x1, slope


def largest_within(points: list[tuple[int, int]], budget: float) -> float:
    """The longest Refresh whose peak fits `budget`: between measured points by linear
    interpolation, past the longest along the fit's slope."""
    points = sorted(points)
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if y0 <= budget < y1:
            return x0 + (budget - y0) * (x1 - x0) / (y1 - y0)
    intercept, slope = fit(points)
    return (budget - intercept) / slope


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--max-num-logits", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--shape", default="llada-8b", choices=tuple(SHAPES))
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--time-tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget-gib", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    args = ap.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    from vllm_dllm.models.token_chunks import logits_tile_bytes

    max_len = max(max(args.tokens), args.time_tokens)
    max_len = 1 << (max_len - 1).bit_length()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, config = make_model_dir(pathlib.Path(tmp), args.shape, args.layers, max_len)
        vocab = config["vocab_size"]
        hidden = config.get("d_model") or config["hidden_size"]
        result = {"shape": args.shape, "widths": {**SHAPES[args.shape][1], "vocab": vocab, "dtype": "bfloat16"},
                  "layers": args.layers, "tokens": args.tokens, "runs": []}
        for rows in args.max_num_logits:
            llm = LLM(model=str(model_dir), load_format="dummy", dtype="bfloat16", max_model_len=max_len,
                      max_num_batched_tokens=max_len, max_num_seqs=4,
                      kv_cache_memory_bytes=2 * max_len * 2 * hidden * 2 * args.layers,
                      enforce_eager=True, seed=0, additional_config={"dllm": {"max_num_logits": rows}})
            run = {"max_num_logits": rows, "logits_tile_bytes": logits_tile_bytes(rows, vocab), "points": []}
            for tokens in args.tokens:
                point = {"tokens": tokens}
                for chunked in (False, True):
                    (value,) = llm.collective_rpc(refresh_forward, args=(tokens, chunked, "peak", vocab))
                    point["chunked" if chunked else "whole"] = value[0]
                    if chunked:
                        point["ffn_chunk_rows"] = value[1]
                run["points"].append(point)
                print(rows, point, flush=True)
            times = {"whole": [], "chunked": []}
            for _ in range(args.repeats):
                for chunked in (False, True):
                    (value,) = llm.collective_rpc(refresh_forward, args=(args.time_tokens, chunked, "time", vocab))
                    times["chunked" if chunked else "whole"].append(value[0])
            run["time_tokens"] = args.time_tokens
            run["seconds"] = {k: statistics.median(v) for k, v in times.items()}
            result["runs"].append(run)
            llm.llm_engine.engine_core.shutdown()
            del llm
    for run in result["runs"]:
        for side in ("whole", "chunked"):
            run[f"fit_{side}"] = fit([(p["tokens"], p[side]) for p in run["points"]])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    text = table(result, args.budget_gib)
    (args.out / "table.md").write_text(text)
    print(text)
    return 0


def table(result: dict, budgets: list[float]) -> str:
    mib = 1 << 20
    shape = result.get("shape", "llada-8b")
    lines = [f"{shape} widths, bfloat16, {result['layers']} layer(s); peak live bytes of one Refresh forward "
             "above those live before it (MiB)", ""]
    for run in result["runs"]:
        tile = run["logits_tile_bytes"]
        lines += [f"max_num_logits {run['max_num_logits']}: LM-head tile {tile / mib:.0f} MiB (float32 logits)", "",
                  "| tokens | whole | FFN chunked | whole / chunked | FFN chunk rows |", "|---|---|---|---|---|"]
        for p in run["points"]:
            lines.append(f"| {p['tokens']} | {p['whole'] / mib:.0f} | {p['chunked'] / mib:.0f} | "
                         f"{p['whole'] / p['chunked']:.2f}x | {p['ffn_chunk_rows']} |")
        (_, b0), (_, b1) = run["fit_whole"], run["fit_chunked"]
        lines += ["", f"Past the tile a token costs {b0 / 1024:.1f} KiB whole, {b1 / 1024:.1f} KiB with the FFN chunked.",
                  "", "| activation budget | largest Refresh, whole | largest Refresh, FFN chunked | ratio |",
                  "|---|---|---|---|"]
        for gib in budgets:
            budget = gib * (1 << 30)
            whole, chunked = (largest_within([(p["tokens"], p[side]) for p in run["points"]], budget)
                              for side in ("whole", "chunked"))
            lines.append(f"| {gib:g} GiB | {whole:,.0f} | {chunked:,.0f} | {chunked / whole:.2f}x |")
        s = run["seconds"]
        lines += ["", f"Refresh forward of {run['time_tokens']} tokens: whole {s['whole']:.2f} s, chunked "
                  f"{s['chunked']:.2f} s ({s['chunked'] / s['whole']:.3f}x), medians", ""]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
