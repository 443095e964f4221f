"""The plugin against a Fast-dLLM-style plain batched loop on the shipped task model, at
equal work, one request at a time and 32 concurrent, quiet and beside a busy neighbour.

    python benchmarks/plain_loop.py --out benchmarks/results/plain-loop [--repeats 3] [--batch 8] \
        [--dtype float32|bfloat16] [--orders length,arrival]

Plain loop: written here from Fast-dLLM's published dual-cache algorithm
(`generate_with_dual_cache`), in plain torch (SDPA attention, the shipped model's
weights in `--dtype` (float32 by default; bfloat16 is the checkpoint's dtype, what
`vllm serve` loads it in, and what Fast-dLLM's scripts load; norms, RoPE and softmax
in float32 as the official model computes them), torch's default threads, one
process, no vLLM).  Per block of 8: one
forward over the whole sequence writes every layer's K/V and gives the logits of every
position; each further step of the block runs only the block's 8 positions over the
cached K/V (theirs written fresh) and projects those 8.  Greedy low-confidence
remasking, the fixed schedule (32 steps over 4 blocks: one token a step).  A batch of
prompts is left-padded to one length with a key padding mask (RoPE positions count from
each row's first token).  32 prompts run as batches of `--batch` (8 by default, as in
the issue's table), in two orders: sorted by length first, so that a batch pads as
little as it can (retrieval prompts are ~380 tokens, the other tasks' ~40), and in
arrival order, as Fast-dLLM's code batches a list of prompts (a batch pads to its
longest); one request at a time is a batch of 1.  The loop gives the oracle's
dual-cache tokens (tests/oracle.py), alone and
padded in a batch (checked when it was written).

Plugin: `benchmarks/engine_overhead.py`'s `default` setting in the same dtype
(`vllm.LLM`, multiprocess,
the plugin's CPU-thread default), the same prompts (held-out task instances in the
chat frame), a 32-token canvas, block 8, 32 steps, dual cache, ignore_eos.

Equal work: both denoise every canvas position of every request in 32 steps (4 of
them full forwards) and commit 32 tokens per request; committed tokens/s = 32 x
requests / wall time.  The busy neighbour is an unrelated `python -c "while True:
pass"`, unpinned, for the whole run of each side.  Each side runs in a fresh process:
one warm-up, then `--repeats` timed runs; the median is reported.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
GEN, BLOCK, STEPS = 32, 8, 32
ORDERS = ("length", "arrival")


# ---- the plain loop ---------------------------------------------------------------


class PlainLLaDA:
    """The shipped LLaDA-format checkpoint as plain tensors: embedding, per layer
    RMSNorm -> q/k/v -> neox RoPE -> SDPA -> out, RMSNorm -> SwiGLU; final norm, head."""

    def __init__(self, model_dir: pathlib.Path, dtype: str = "float32"):
        import torch
        from safetensors.torch import load_file

        config = json.loads((model_dir / "config.json").read_text())
        to = getattr(torch, dtype)
        state = {k: v.to(to) for k, v in load_file(str(model_dir / "model.safetensors")).items()}
        self.heads = config["n_heads"]
        self.head_dim = config["d_model"] // self.heads
        self.eps = config["rms_norm_eps"]
        self.mask_id = config["mask_token_id"]
        p = "model.transformer."
        self.embed, self.norm, self.head = state[p + "wte.weight"], state[p + "ln_f.weight"], state[p + "ff_out.weight"]
        self.layers = [
            {name: state[f"{p}blocks.{i}.{name}.weight"] for name in
             ("attn_norm", "q_proj", "k_proj", "v_proj", "attn_out", "ff_norm", "ff_proj", "up_proj", "ff_out")}
            for i in range(config["n_layers"])
        ]
        dim = self.head_dim
        self.inv_freq = 1.0 / (config["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))

    def _rms(self, x, weight):
        import torch

        # Statistics in float32 whatever the weights' dtype, as the official model does.
        x32 = x.float()
        return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def _rope(self, x, positions):
        import torch

        freqs = positions[..., None].float() * self.inv_freq  # [B, Q, D/2]
        cos, sin = freqs.cos()[:, None], freqs.sin()[:, None]  # [B, 1, Q, D/2]
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    def forward(self, ids, positions, key_mask, cache=None, start: int = 0):
        """Logits [B, Q, V] of ids[B, Q] at sequence offsets start..start+Q.  Without a
        cache the queries are the whole sequence and the per-layer K/V are returned;
        with one, the queries' K/V replace theirs in it (the dual cache's block)."""
        import torch.nn.functional as F

        batch, queries = ids.shape
        x = self.embed[ids]
        new_cache = []
        for i, w in enumerate(self.layers):
            h = self._rms(x, w["attn_norm"])
            shape = (batch, queries, self.heads, self.head_dim)
            q = self._rope(F.linear(h, w["q_proj"]).view(shape).transpose(1, 2), positions)
            k = self._rope(F.linear(h, w["k_proj"]).view(shape).transpose(1, 2), positions)
            v = F.linear(h, w["v_proj"]).view(shape).transpose(1, 2)
            if cache is None:
                keys, values = k, v
                new_cache.append((k, v))
            else:
                keys, values = cache[i]
                keys[:, :, start : start + queries] = k
                values[:, :, start : start + queries] = v
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=key_mask[:, None, None, :])
            x = x + F.linear(out.transpose(1, 2).reshape(batch, queries, -1), w["attn_out"])
            h = self._rms(x, w["ff_norm"])
            x = x + F.linear(F.silu(F.linear(h, w["ff_proj"])) * F.linear(h, w["up_proj"]), w["ff_out"])
        return F.linear(self._rms(x, self.norm), self.head), (new_cache if cache is None else cache)


def plain_generate(model: PlainLLaDA, prompts: list[list[int]]):
    """Fast-dLLM's dual-cache loop over one batch; returns the canvases [B, GEN]."""
    import torch

    batch = len(prompts)
    width = max(map(len, prompts))
    total = width + GEN
    ids = torch.full((batch, total), model.mask_id, dtype=torch.long)
    key_mask = torch.ones(batch, total, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        pad = width - len(prompt)
        ids[row, pad:width] = torch.tensor(prompt)
        key_mask[row, :pad] = False
    positions = (torch.cumsum(key_mask.long(), dim=1) - 1).clamp(min=0)
    steps_per_block = STEPS // (GEN // BLOCK)
    for block in range(GEN // BLOCK):
        lo, hi = width + block * BLOCK, width + (block + 1) * BLOCK
        # The fixed schedule: m // steps per step, the first m % steps one more.
        base, extra = divmod(BLOCK, steps_per_block)
        cache = None
        for step in range(steps_per_block):
            if cache is None:
                logits, cache = model.forward(ids, positions, key_mask)
                logits = logits[:, lo:hi]
            else:
                logits, cache = model.forward(ids[:, lo:hi], positions[:, lo:hi], key_mask, cache, lo)
            masked = ids[:, lo:hi] == model.mask_id
            probs = torch.softmax(logits.float(), dim=-1)
            tokens = probs.argmax(dim=-1)
            confidence = probs.gather(-1, tokens[..., None])[..., 0].masked_fill(~masked, -math.inf)
            count = base + (step < extra)
            chosen = confidence.topk(count, dim=-1).indices
            block_ids = ids[:, lo:hi]
            block_ids.scatter_(1, chosen, tokens.gather(1, chosen))
    return ids[:, width:]


def run_plain(args) -> dict:
    import torch

    from vllm_dllm.default_model import PATH
    from engine_overhead import build_prompts
    from transformers import AutoTokenizer

    prompts, _ = build_prompts(AutoTokenizer.from_pretrained(str(PATH)), args.num_requests, args.seed)
    if args.orders == "length":
        # Batches of similar lengths: the least padding a plain batched loop can have.
        prompts.sort(key=len)
    model = PlainLLaDA(pathlib.Path(PATH), args.dtype)
    batch = min(args.batch, len(prompts))

    def once() -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            for first in range(0, len(prompts), batch):
                canvas = plain_generate(model, prompts[first : first + batch])
                assert not bool((canvas == model.mask_id).any()), "a canvas position was left masked"
        return time.perf_counter() - start

    once()  # warm-up
    walls = sorted(once() for _ in range(args.repeats))
    return {"wall_s_all": walls, "wall_s": walls[len(walls) // 2], "torch_threads": torch.get_num_threads(),
            "batch": batch, "num_requests": len(prompts), "order": args.orders, "dtype": args.dtype}


# ---- driver ---------------------------------------------------------------------


def with_neighbour(busy: bool, command: list[str], timeout: int) -> subprocess.CompletedProcess:
    neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()


def measure_plain(args, n: int, busy: bool, order: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "plain.json"
        proc = with_neighbour(busy, [sys.executable, __file__, "--child", "--child-out", str(out), "--num-requests",
                                     str(n), "--batch", str(args.batch), "--repeats", str(args.repeats),
                                     "--seed", str(args.seed), "--orders", order, "--dtype", args.dtype],
                              args.timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"plain loop failed: {proc.stderr[-2000:]}")
        return json.loads(out.read_text())


def measure_plugin(args, n: int, busy: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp)
        command = [sys.executable, str(HERE / "engine_overhead.py"), "--label", "plugin", "--settings", "default",
                   "--num-requests", str(n), "--repeats", str(args.repeats), "--seed", str(args.seed),
                   "--dtype", args.dtype, "--out", str(out)]
        proc = with_neighbour(busy, command, args.timeout)
        if proc.returncode != 0 or not (out / "results.json").exists():
            raise RuntimeError(f"plugin run failed: {proc.stderr[-2000:]}")
        result = json.loads((out / "results.json").read_text())["results"][0]
        return {"wall_s": result["wall_s"], "wall_s_all": result["wall_s_all"], "num_requests": n}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=pathlib.Path)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8, help="the plain loop's batch for 32 concurrent prompts")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="both sides; the checkpoint and Fast-dLLM's official runs are bfloat16")
    ap.add_argument("--orders", default="length,arrival",
                    help="the plain loop's batchings of the concurrent prompts: 'length' (sorted by prompt "
                         "length first: the least padding) and/or 'arrival' (in arrival order, as Fast-dLLM's "
                         "code batches them); one at a time has no order")
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", type=pathlib.Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        sys.path.insert(0, str(HERE))
        args.child_out.write_text(json.dumps(run_plain(args)))
        return 0
    if args.out is None:
        ap.error("--out is required")

    orders = args.orders.split(",")
    if not set(orders) <= set(ORDERS):
        ap.error(f"--orders: choose from {', '.join(ORDERS)}")
    rows = []
    for n in (args.num_requests, 1):
        for busy in (False, True):
            plugin = measure_plugin(args, n, busy)
            for order in orders if n > 1 else orders[:1]:
                plain = measure_plain(args, n, busy, order)
                row = {"requests": n, "busy_neighbour": busy, "order": order if n > 1 else "-", "plugin": plugin,
                       "plain": plain, "plugin_tok_s": GEN * n / plugin["wall_s"],
                       "plain_tok_s": GEN * n / plain["wall_s"]}
                row["ratio"] = row["plugin_tok_s"] / row["plain_tok_s"]
                rows.append(row)
                print(f"{n:3d} requests, {'busy' if busy else 'quiet'}, plain batches by {row['order']}: plugin "
                      f"{row['plugin_tok_s']:.0f} tok/s, plain {row['plain_tok_s']:.0f} tok/s, {row['ratio']:.2f}x",
                      file=sys.stderr, flush=True)
    quiet = {(r["requests"], r["order"]): r for r in rows if not r["busy_neighbour"]}
    lines = [f"dtype {args.dtype}; the plain loop's batch for {args.num_requests} concurrent: {args.batch}", "",
             "| requests | neighbour | plain loop's batches | plugin tok/s | plain loop tok/s | plugin / plain "
             "| plugin busy / quiet | plain busy / quiet |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        q = quiet[(r["requests"], r["order"])]
        lines.append(
            f"| {r['requests']} | {'busy' if r['busy_neighbour'] else 'quiet'} | {r['order']} "
            f"| {r['plugin_tok_s']:.0f} | {r['plain_tok_s']:.0f} | {r['ratio']:.2f}x "
            f"| {r['plugin_tok_s'] / q['plugin_tok_s']:.2f} | {r['plain_tok_s'] / q['plain_tok_s']:.2f} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"argv": sys.argv, "rows": rows}, indent=1))
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
