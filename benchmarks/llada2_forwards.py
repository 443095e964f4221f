"""Forwards per block and per returned token for LLaDA2.x: the plugin through vLLM's
engine against (a) the official generate() loop (tests/oracle_llada2.py: a whole-window
forward per step, no cache) and (b) a cached loop that spends one extra forward per
finished block to write its K/V (what SGLang's and dInfer's block loops do).

The plugin's steps are counted on vLLM's own counter (vllm:diffusion_num_denoising_steps),
one request at a time; the reference's forwards by the oracle, on the same prompts.
Counts, not times: they do not depend on the machine.

    python benchmarks/llada2_forwards.py --out benchmarks/results/llada2-forwards [--shape tiny|small] [--n 16]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # lab/ sits at the repository root

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES = {
    # make_tiny arguments; small: LLaDA2-mini's proportions at a CPU size (GQA 4:1,
    # dense first layer, 16 experts top-4 in 4 groups, a shared expert).
    "tiny": dict(hidden=128, layers=2, heads=2),
    "small": dict(hidden=256, layers=4, heads=8, kv_heads=2, intermediate=512),
}
SETTINGS = {
    "2.0 threshold 0.95": {"threshold": 0.95},
    "2.0 threshold 0.5": {"threshold": 0.5},
    "2.1 quality": {"mode": "quality"},
    "2.1 speed": {"mode": "speed"},
}
MODES = {"quality": {"threshold": 0.7, "editing_threshold": 0.5, "max_post_steps": 16},
         "speed": {"threshold": 0.5, "editing_threshold": 0.0, "max_post_steps": 16}}


def reference_options(xargs: dict) -> dict:
    options = dict(xargs)
    mode = options.pop("mode", None)
    return {**MODES[mode], **options} if mode else options


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--n", type=int, default=16, help="prompts per setting")
    ap.add_argument("--block-length", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from tests.oracle_llada2 import llada2_generate, load_llada2_oracle
    from vllm import SamplingParams

    from lab import eval as task_eval
    from vllm_dllm.tools.make_tiny import make_tiny

    scratch = pathlib.Path(tempfile.mkdtemp(prefix="llada2-forwards-"))
    model_dir = str(make_tiny("llada2", scratch / args.shape, seed=7, **SHAPES[args.shape]))
    ids = json.loads((pathlib.Path(model_dir) / "generation_config.json").read_text())
    runner = task_eval.OfflineRunner(model_dir, dict(dtype="float32", max_model_len=512, max_num_seqs=4,
                                                      kv_cache_memory_bytes=64 << 20, enforce_eager=True,
                                                      gpu_memory_utilization=0.3, seed=0))
    oracle = load_llada2_oracle(model_dir)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randint(3, 3 * args.block_length))] for _ in range(args.n)]
    rows = []
    for name, setting in SETTINGS.items():
        xargs = {"block_length": args.block_length, **setting}
        total = dict(plugin=0, reference=0, extra=0, blocks=0, tokens=0, mismatches=0)
        for i, prompt in enumerate(prompts):
            before = runner._steps()
            out = runner.generate([prompt], SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                                           extra_args=xargs))[0]
            steps = runner._steps() - before
            want = llada2_generate(oracle, prompt, gen_length=args.max_tokens, mask_id=ids["mask_token_id"],
                                   eos_id=ids["eos_token_id"], **reference_options(xargs))
            total["mismatches"] += list(out.token_ids) != want.tokens
            total["plugin"] += steps
            total["reference"] += want.forwards
            total["extra"] += want.forwards + want.blocks - 1
            total["blocks"] += want.blocks
            total["tokens"] += len(want.tokens)
        row = {"setting": name, **total}
        for key in ("plugin", "reference", "extra"):
            row[f"{key}_per_block"] = total[key] / total["blocks"]
            row[f"{key}_per_token"] = total[key] / total["tokens"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    runner.engine.engine_core.shutdown()

    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"shape": args.shape, **SHAPES[args.shape], "n": args.n, "block_length": args.block_length,
            "max_tokens": args.max_tokens, "seed": args.seed}
    (args.out / f"{args.shape}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [f"# LLaDA2 forwards per block ({args.shape}: {json.dumps(meta)})", "",
             "| setting | blocks | tokens | plugin / block | reference / block | extra-forward loop / block "
             "| plugin / token | reference / token | extra / token | plugin vs extra | outputs differing |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['setting']} | {r['blocks']} | {r['tokens']} | {r['plugin_per_block']:.2f} | "
            f"{r['reference_per_block']:.2f} | {r['extra_per_block']:.2f} | {r['plugin_per_token']:.3f} | "
            f"{r['reference_per_token']:.3f} | {r['extra_per_token']:.3f} | {r['plugin'] / r['extra']:.3f}x | "
            f"{r['mismatches']} |")
    (args.out / f"{args.shape}.md").write_text("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.27
    for k, (key, label) in enumerate((("plugin", "plugin"), ("reference", "official generate()"),
                                      ("extra", "cached loop, +1 forward per block"))):
        ax.bar([i + (k - 1) * width for i in range(len(rows))], [r[f"{key}_per_block"] for r in rows], width,
               label=label)
    ax.set_xticks(range(len(rows)), [r["setting"] for r in rows])
    ax.set_ylabel("forwards per block")
    ax.set_title(f"LLaDA2 forwards per block ({args.shape} random model, block {args.block_length})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / f"{args.shape}.png", dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
