"""Step engine vs an ideal batched step, on an LLaDA-8B-shaped plain-torch model.

    python benchmarks/step_bench.py --out benchmarks/results/step-gpu     # CUDA, bf16, 8B shape
    python benchmarks/step_bench.py --small --out benchmarks/results/step  # CPU, small shape
    python benchmarks/step_bench.py --smoke --out /tmp/step-smoke          # every case, toy sizes

Imports no vLLM, so it runs on a bare GPU machine (torch + triton).  Each case runs
our engine (vllm_dllm.engine.StepEngine over the paged pool, with the backend chosen
for the device) and, in the same invocation, an ideal implementation of the same
maths: dense per-request K/V, one SDPA per layer over the padded batch, one LM head
over all rows, the rule as a handful of batched ops.  Reported: median ms per step,
and the ratio ours / ideal.  Also the torch ops one engine step dispatches at 1, 4
and 16 requests (the step's cost must not grow with per-request Python).

Cases: Refresh of one sequence; Reuse steps (32-query blocks) of N requests over a
context; the LM head + LLaDA rule over N x 32 rows at T = 0 and T = 1; on CUDA, a
Reuse step of 1 request with CUDA graphs (ours: the engine replaying its captured
forward; ideal: the whole ideal step captured in one graph).  What whole-step graphs
save in a call's later steps is benchmarks/later_steps.py's.

LLaDA2 (block-causal) decode step of N requests (16 and 64): each request's active
block, the last 32 positions of its context, over the cached prefix, through the
engine's block-causal phase and the LLaDA2.0 rule (threshold 1: one token a step, so
every measured step is an in-block step); ideal: the same forward of the last block
over dense K/V with an argmax head.  The body is the same dense stand-in: LLaDA2's MoE
runs in vLLM's FusedMoE, the same kernel for ours and an ideal step, so it is left out.

Sparse vs dense Reuse attention: one layer's attention of a Reuse step of
16 requests x 32-query blocks over a context L, dense (cache dual: each query block
attends over all L positions) against sparse (cache sparse, retention 0.3: over the
kept + 32 slots).  Both go through the engine's own path: StepEngine.layout() for
the requests' phase and slots, build_step_inputs, and the device's backend `attend`
over one layer's paged pool (random q/k/v and pool contents; the pool holds exactly
the blocks the scheduler would reserve).  Reported: median ms of `attend` (per
layer), of build_step_inputs (once per step), and an ideal SDPA over contiguous K/V
of the same lengths; ratio sparse / dense.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from vllm_dllm.attention.backends import select_backend  # noqa: E402
from vllm_dllm.decoding.base import SpecialIds  # noqa: E402
from vllm_dllm.decoding.logits import chunked_reduce  # noqa: E402
from vllm_dllm.engine.engine import StepEngine  # noqa: E402
from vllm_dllm.engine.op_count import OpCounter  # noqa: E402
from vllm_dllm.engine.step_inputs import build_step_inputs  # noqa: E402
from vllm_dllm.engine.torch_model import LLADA_8B, ModelShape, build_model, rms_norm  # noqa: E402
from vllm_dllm.kv_footprint import sequence_slots  # noqa: E402
from vllm_dllm.scheduler.track import RequestTrack  # noqa: E402
from vllm_dllm.options import LLaDA2Options, LLaDAOptions  # noqa: E402

BLOCK = 32
BLOCK_SIZE = 16
SMALL = ModelShape(vocab_size=8192, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4, num_kv_heads=4)
# --smoke: every case and code path of a full run at toy sizes, so a run on a scarce
# GPU machine is not the first time the script meets that device's branches.
TOY = ModelShape(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=2)


# The engine's candidate windows: None, the device's default (on for CUDA);
# --candidate-rows sets False, the candidates listed by a sync each step.
WINDOW_CANDIDATES: bool | None = None
SPARSE_RETENTION = 0.3
STREAM = 32  # attend calls timed back to back: one per layer of LLaDA-8B


def options(gen: int, cache: str, temperature: float = 0.0, **cache_options) -> LLaDAOptions:
    return LLaDAOptions(
        gen_length=gen, steps=gen, block_length=BLOCK, remasking="low_confidence", temperature=temperature,
        cfg_scale=0.0, logits_eos_inf=False, confidence_eos_eot_inf=False, cache=cache, **cache_options,
    )


class Timer:
    def __init__(self, device: torch.device):
        self.device = device

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def median_ms(self, fn, reps: int, warmup: int = 2) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            self.sync()
            start = time.perf_counter()
            fn()
            self.sync()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)


# ---- ours -------------------------------------------------------------------


def make_engine(model, requests: int, context: int, device, max_num_logits: int = 1024,
                cuda_graphs: bool = False, kind: str = "llada", step_graphs: bool = True) -> StepEngine:
    blocks = -(-context // BLOCK_SIZE)
    model.allocate_kv_pool(requests * blocks + 1, BLOCK_SIZE, next(model.parameters()).dtype, device)
    vocab = model.shape.vocab_size
    return StepEngine(
        model, kind=kind, ids=SpecialIds(mask=vocab - 1, eos=vocab - 2, eot=vocab - 3), capacity=requests,
        max_model_len=context, block_size=BLOCK_SIZE, max_num_logits=max_num_logits,
        backend=select_backend(device), device=device, cuda_graphs=cuda_graphs,
        window_candidates=WINDOW_CANDIDATES, step_graphs=step_graphs,
    )


def add(engine: StepEngine, requests: int, context: int, gen: int, cache: str, temperature: float = 0.0) -> list[str]:
    blocks = -(-context // BLOCK_SIZE)
    ids = []
    for i in range(requests):
        prompt = [(17 * i + j) % 1000 + 10 for j in range(context - gen)]
        engine.add(f"r{i}", prompt, options(gen, cache, temperature), seed=i,
                   block_ids=list(range(1 + i * blocks, 1 + (i + 1) * blocks)))
        ids.append(f"r{i}")
    return ids


def llada2_options(gen: int) -> LLaDA2Options:
    # Threshold 1 is never exceeded: one token a step, the block stays open.
    return LLaDA2Options(
        max_tokens=gen, block_length=BLOCK, steps=BLOCK, threshold=1.0, minimal_topk=1, eos_early_stop=False,
        editing_threshold=None, max_post_steps=16, num_to_transfer=1, temperature=0.0, top_k=None, top_p=None,
    )


def add_llada2(engine: StepEngine, requests: int, context: int) -> list[str]:
    """Requests whose last block follows a prompt of context - BLOCK tokens."""
    blocks = -(-context // BLOCK_SIZE)
    ids = []
    for i in range(requests):
        prompt = [(17 * i + j) % 1000 + 10 for j in range(context - BLOCK)]
        engine.add(f"r{i}", prompt, llada2_options(BLOCK), seed=i,
                   block_ids=list(range(1 + i * blocks, 1 + (i + 1) * blocks)))
        ids.append(f"r{i}")
    return ids


def ours_llada2(model, requests, context, timer, reps, device):
    """An in-block LLaDA2 step: each request's last block over its cached prefix."""
    reps = min(reps, BLOCK - 3)  # more would step past the block's last in-block step
    engine = make_engine(model, requests, context, device, kind="llada2")
    ids = add_llada2(engine, requests, context)
    engine.step(ids)  # the prompt's blocks with the first step; every later step is the block alone
    ms = timer.median_ms(lambda: engine.step(ids), reps)
    release(model)
    return ms


def release(model) -> None:
    for attn in model.attention_layers():
        attn.bind_kv_cache(None)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def ours_reuse(model, requests, context, timer, reps, device, cuda_graphs=False):
    engine = make_engine(model, requests, context, device, cuda_graphs=cuda_graphs)
    gen = BLOCK * max(1, (reps + 4) // BLOCK + 1)
    ids = add(engine, requests, context, gen, "dual")
    engine.step(ids)  # the Refresh that fills the cache; every later step of the block is a Reuse
    ms = timer.median_ms(lambda: engine.step(ids), reps)
    release(model)
    return ms


def ours_refresh(model, context, timer, reps, device):
    engine = make_engine(model, 1, context, device)
    ids = add(engine, 1, context, BLOCK * ((reps + 4) // BLOCK + 1), "none")
    ms = timer.median_ms(lambda: engine.step(ids), reps)
    release(model)
    return ms


def ours_head(model, requests, temperature, timer, reps, device):
    """LM head + rule over requests x 32 candidate rows, through the engine's path."""
    engine = make_engine(model, requests, 2 * BLOCK, device)
    add(engine, requests, 2 * BLOCK, BLOCK, "none", temperature)
    hidden = torch.randn(requests * 2 * BLOCK, model.shape.hidden_size, device=device,
                         dtype=next(model.parameters()).dtype)
    slots = torch.arange(requests, device=device)

    def reduce(rows, positions):
        cond = rows * 2 * BLOCK + BLOCK + positions
        return chunked_reduce(hidden, cond, slots[rows], positions, model.compute_logits, engine.rule,
                              engine.max_num_logits)

    def run():
        # Measure the same step again and again: denoise, then put the canvas back.
        canvas = engine.decode.canvas.clone()
        engine.rule.denoise(slots.cpu(), slots, BLOCK, reduce)
        engine.decode.canvas.copy_(canvas)
        engine.decode.step[slots] -= 1

    ms = timer.median_ms(run, reps)
    release(model)
    return ms


def reuse_attention(model, requests, context, cache, timer, reps, device) -> dict:
    """One layer's attention in a Reuse step of `requests` 32-query blocks over
    `context` positions, through the engine's layout, step inputs and backend.

    cache "dual": every block attends over the whole sequence (seq_len = context);
    "sparse": over the kept positions and the block (seq_len = kept + 32).  The pool
    is one layer's page tensor with the blocks the scheduler reserves per request."""
    s = model.shape
    dtype = next(model.parameters()).dtype
    extra = {"retention": SPARSE_RETENTION, "delay_step": 1} if cache == "sparse" else {}
    opts = options(2 * BLOCK, cache, **extra)
    prompt_len = context - opts.gen_length
    blocks = -(-sequence_slots(opts, prompt_len) // BLOCK_SIZE)
    vocab = s.vocab_size
    engine = StepEngine(
        model, kind="llada", ids=SpecialIds(mask=vocab - 1, eos=vocab - 2, eot=vocab - 3), capacity=requests,
        max_model_len=context, block_size=BLOCK_SIZE, max_num_logits=1024, backend=select_backend(device),
        device=device,
    )
    # Random contents made on the device, in the model's dtype: at L = 16384 the pool
    # holds ~2G values, tens of seconds to draw on the host.
    gen = torch.Generator(device=device).manual_seed(0)
    pool = torch.randn(requests * blocks + 1, BLOCK_SIZE, 2, s.num_kv_heads, s.head_dim, generator=gen,
                       device=device, dtype=dtype)
    for i in range(requests):
        engine.add(f"r{i}", [(17 * i + j) % 1000 + 10 for j in range(prompt_len)], opts, seed=i,
                   block_ids=list(range(1 + i * blocks, 1 + (i + 1) * blocks)))
    # Past the block's Refresh steps (and the sparse delayed update): a Reuse step.
    engine.host.has_cache[:requests] = True
    engine.host.block_step[:requests] = opts.delay_step + 1
    batch = engine.layout(np.arange(requests))
    assert not batch.refresh.any() and not batch.rebuild.any() and batch.fill is None

    def inputs():
        step = build_step_inputs(
            batch.sequences, prompt_tokens=engine.prompt_tokens, prompt_len=engine.prompt_len,
            canvas=engine.decode.canvas, snapshot=engine.snapshot, block_table=engine.block_table,
            block_size=BLOCK_SIZE, mask_id=engine.ids.mask, backend=engine.backend, fill=batch.fill,
        )
        if engine.backend.name == "torch":
            step.metadata.groups  # built on first use: per-step input work of this backend
        return step

    step = inputs()
    seq_len = int(batch.sequences.seq_len[0])
    rows = len(step.positions)
    q = torch.randn(rows, s.num_heads, s.head_dim, generator=gen, device=device, dtype=dtype)
    k, v = (torch.randn(rows, s.num_kv_heads, s.head_dim, generator=gen, device=device, dtype=dtype) for _ in range(2))
    scale = s.head_dim**-0.5
    attn_ms = timer.median_ms(lambda: engine.backend.attend(q, k, v, pool, step.metadata, scale), reps)
    # Back to back, as a step's layers run: the host's launch work overlaps the device's.
    attn_stream_ms = timer.median_ms(lambda: [engine.backend.attend(q, k, v, pool, step.metadata, scale)
                                              for _ in range(STREAM)], reps) / STREAM
    inputs_ms = timer.median_ms(inputs, reps)
    pool = step = None  # free the pool before the ideal's K/V
    # Ideal: one SDPA over contiguous K/V of the same length (no pool, no gather).
    keys, values = (torch.randn(requests, s.num_kv_heads, seq_len, s.head_dim, generator=gen, device=device,
                                dtype=dtype) for _ in range(2))
    grid = q.view(requests, BLOCK, s.num_heads, s.head_dim).transpose(1, 2)
    ideal_ms = timer.median_ms(lambda: F.scaled_dot_product_attention(
        grid, keys, values, scale=scale, enable_gqa=s.num_heads != s.num_kv_heads), reps)
    keys = values = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"cache": cache, "seq_len": seq_len, "kv_blocks_per_request": blocks, "attn_ms": round(attn_ms, 3),
            "attn_stream_ms": round(attn_stream_ms, 3),
            "inputs_ms": round(inputs_ms, 3), "ideal_sdpa_ms": round(ideal_ms, 3)}


# ---- ideal ------------------------------------------------------------------


class IdealStep:
    """The same maths with dense per-request K/V and no bookkeeping at all."""

    def __init__(self, model, requests: int, context: int, device):
        s = model.shape
        dtype = next(model.parameters()).dtype
        self.model, self.requests, self.context = model, requests, context
        self.kv = [torch.zeros(2, requests, s.num_kv_heads, context, s.head_dim, dtype=dtype, device=device)
                   for _ in model.layers]
        self.ids = torch.randint(0, s.vocab_size - 4, (requests, context), device=device)
        self.positions = torch.arange(context, device=device)

    def forward(self, start: int, length: int, write: bool) -> torch.Tensor:
        m, s = self.model, self.model.shape
        n = self.requests
        pos = self.positions[start : start + length]
        x = m.embed(self.ids[:, start : start + length]).reshape(n * length, -1)
        flat_pos = pos.repeat(n)
        for layer, kv in zip(m.layers, self.kv):
            q, k, v = layer.qkv(rms_norm(x, layer.input_norm)).split([layer.q_size, layer.kv_size, layer.kv_size], -1)
            q = layer.rope(flat_pos, q.view(n * length, -1, s.head_dim))
            k = layer.rope(flat_pos, k.view(n * length, -1, s.head_dim))
            k = k.view(n, length, -1, s.head_dim).transpose(1, 2)
            v = v.view(n, length, -1, s.head_dim).transpose(1, 2)
            kv[0][:, :, start : start + length] = k
            kv[1][:, :, start : start + length] = v
            keys, values = (kv[0], kv[1]) if not write or length < self.context else (k, v)
            o = F.scaled_dot_product_attention(
                q.view(n, length, -1, s.head_dim).transpose(1, 2), keys, values,
                enable_gqa=s.num_heads != s.num_kv_heads,
            )
            x = x + layer.out(o.transpose(1, 2).reshape(n * length, -1))
            gate, up = layer.gate_up(rms_norm(x, layer.post_attn_norm)).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        return rms_norm(x, m.final_norm)

    def head(self, hidden: torch.Tensor, temperature: float) -> torch.Tensor:
        logits = self.model.compute_logits(hidden)
        if temperature > 0:
            noise = -torch.log(torch.rand(logits.shape, dtype=torch.float64, device=logits.device))
            tokens = (logits.double().exp() / noise**temperature).argmax(-1)
        else:
            tokens = logits.argmax(-1)
        conf = torch.softmax(logits.float(), -1).gather(1, tokens[:, None]).view(self.requests, -1)
        return torch.topk(conf, 1, dim=1).indices

    def step(self, start: int, length: int, write: bool, temperature: float = 0.0):
        hidden = self.forward(start, length, write)
        return self.head(hidden.view(self.requests, length, -1)[:, -BLOCK:].reshape(-1, hidden.shape[-1]),
                         temperature)


def ideal_reuse(model, requests, context, timer, reps, device):
    ideal = IdealStep(model, requests, context, device)
    ideal.step(0, context, True)
    ms = timer.median_ms(lambda: ideal.step(context - BLOCK, BLOCK, False), reps)
    release(model)
    return ms


def ideal_reuse_graphed(model, requests, context, timer, reps, device):
    ideal = IdealStep(model, requests, context, device)
    ideal.step(0, context, True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            ideal.step(context - BLOCK, BLOCK, False)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ideal.step(context - BLOCK, BLOCK, False)
    ms = timer.median_ms(graph.replay, reps)
    del graph
    release(model)
    return ms


def ideal_refresh(model, context, timer, reps, device):
    ideal = IdealStep(model, 1, context, device)
    ms = timer.median_ms(lambda: ideal.step(0, context, True), reps)
    release(model)
    return ms


def ideal_head(model, requests, temperature, timer, reps, device):
    ideal = IdealStep(model, requests, BLOCK, device)
    hidden = torch.randn(requests * BLOCK, model.shape.hidden_size, device=device,
                         dtype=next(model.parameters()).dtype)
    ms = timer.median_ms(lambda: ideal.head(hidden, temperature), reps)
    return ms


# ---- op counts --------------------------------------------------------------


CALL_STEPS = 8  # the server's default max_steps_per_call


def op_counts(device, shape: ModelShape = SMALL) -> list[dict]:
    """Ops of one Reuse step, and of an engine call of Reuse steps (as many as the
    scheduler's steps_in_call gives, up to CALL_STEPS), at 1, 4 and 16 requests (same
    phase mix), small model; for LLaDA (dual cache) and LLaDA2.0 (one token a step
    inside a block over its cached prefix)."""
    model = build_model(shape, torch.float32, device)
    rows = []
    for requests in (1, 4, 16):
        engine = make_engine(model, requests, 256, device)
        ids = add(engine, requests, 256, 4 * BLOCK, "dual")
        engine.step(ids)
        engine.step(ids)
        track = RequestTrack(options(4 * BLOCK, "dual"), 256 - 4 * BLOCK, blocks=0, has_cache=True, block_step=3)
        steps = track.steps_in_call(CALL_STEPS)
        rows.append(_count_ops(engine, ids, [track.call_tokens(steps)] * requests, steps, requests, "llada"))
        release(model)
    for requests in (1, 4, 16):
        engine = make_engine(model, requests, 256, device, kind="llada2")
        ids = add_llada2(engine, requests, 256)
        engine.step(ids)  # the prompt's blocks with the first step; every later step is the block alone
        rows.append(_count_ops(engine, ids, None, CALL_STEPS, requests, "llada2"))
        release(model)
    return rows


def _count_ops(engine, ids, planned, steps: int, requests: int, kind: str) -> dict:
    with OpCounter() as counter:
        engine.step(ids)
    with OpCounter() as call:
        ran = engine.step(ids, planned, steps=steps).steps
    return {"kind": kind, "requests": requests, "ops_per_step": counter.total, "sync_ops_per_step": counter.syncs,
            "call_steps": ran, "ops_per_call": call.total, "sync_ops_per_call": call.syncs}


def save(result: dict, out: pathlib.Path) -> str:
    """Write results.json and table.md; returns the table."""
    cases, sparse_cases = result["cases"], result["sparse_reuse_attention"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["| case | requests | context | ours ms | ideal ms | ratio |", "|---|---|---|---|---|---|"]
    lines += [f"| {c['case']} | {c['requests']} | {c['context']} | {c['ours_ms']} | {c['ideal_ms']} | {c['ratio']} |"
              for c in cases]
    lines += ["", "| rule | requests | ops per step | sync ops per step | steps per call | ops per call (per step) "
              "| sync ops per call |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r.get('kind', 'llada')} | {r['requests']} | {r['ops_per_step']} | {r['sync_ops_per_step']} "
              f"| {r['call_steps']} "
              f"| {r['ops_per_call']} ({r['ops_per_call'] / r['call_steps']:.0f}) | {r['sync_ops_per_call']} |"
              for r in result["op_counts"]]
    lines += ["", f"Reuse attention, one layer, sparse (retention {SPARSE_RETENTION}) vs dense (dual), "
              f"backend {result['backend']}: median ms of `attend` per layer (one call between two syncs, and per call "
              f"of {STREAM} back to back, as a step's layers run), of build_step_inputs per step, "
              "and of an ideal SDPA over contiguous K/V of the same length.", "",
              "| requests | context | dense seq | sparse seq | dense attend ms | sparse attend ms | sparse/dense "
              "| back to back dense / sparse ms | back to back sparse/dense "
              "| dense inputs ms | sparse inputs ms | ideal dense ms | ideal sparse ms | ideal sparse/dense |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['requests']} | {r['context']} | {r['dense']['seq_len']} | {r['sparse']['seq_len']} | "
              f"{r['dense']['attn_ms']} | {r['sparse']['attn_ms']} | {r['ratio']} | "
              f"{r['dense']['attn_stream_ms']} / {r['sparse']['attn_stream_ms']} | {r['stream_ratio']} | "
              f"{r['dense']['inputs_ms']} | "
              f"{r['sparse']['inputs_ms']} | {r['dense']['ideal_sdpa_ms']} | {r['sparse']['ideal_sdpa_ms']} | "
              f"{r['ideal_ratio']} |" for r in sparse_cases]
    (out / "table.md").write_text(f"Device: {result['device']}, torch {result['torch']}\n\n" + "\n".join(lines) + "\n")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="small model and contexts (CPU)")
    parser.add_argument("--smoke", action="store_true",
                        help="every case at toy sizes, one repetition: checks the script, measures nothing")
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--sparse-contexts", default="4096,16384",
                        help="contexts of the sparse vs dense Reuse attention cases")
    parser.add_argument("--sparse-requests", type=int, default=16)
    parser.add_argument("--only-sparse", action="store_true", help="run only the sparse vs dense cases")
    parser.add_argument("--only-op-counts", action="store_true",
                        help="run only the op counts per step and per engine call")
    parser.add_argument("--candidate-rows", action="store_true",
                        help="list each step's candidates (a sync) instead of CUDA's candidate windows")
    args = parser.parse_args()
    global WINDOW_CANDIDATES
    WINDOW_CANDIDATES = False if args.candidate_rows else None

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        shape, dtype, contexts, reuse_requests, refresh_contexts, head_requests = (
            TOY, torch.float32 if device.type == "cpu" else torch.bfloat16, (64,), (1, 4), (64,), 4)
        llada2_requests = (1, 4)
        args.sparse_contexts, args.sparse_requests, args.reps = "256", 4, args.reps or 1
    elif args.small:
        shape, dtype, contexts, reuse_requests, refresh_contexts, head_requests = (
            SMALL, torch.float32, (128, 512), (1, 4, 16, 64), (128, 512), 16)
        llada2_requests = (16, 64)
    else:
        shape, dtype, contexts, reuse_requests, refresh_contexts, head_requests = (
            LLADA_8B, torch.bfloat16, (512, 2048), (1, 4, 16, 64), (512, 4096), 16)
        llada2_requests = (16, 64)
    reps = args.reps or (5 if device.type == "cpu" else 20)
    timer = Timer(device)
    torch.set_grad_enabled(False)
    model = build_model(shape, dtype, device)

    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
        "torch": torch.__version__,
        "shape": {**shape.__dict__, "dtype": str(dtype).replace("torch.", "")},
        "backend": select_backend(device).name,
        "graphs": "case reuse_graphed" if device.type == "cuda" else "CUDA only: not measured on a CPU",
        "reps": reps,
        "cases": [],
        "sparse_reuse_attention": [],
        "op_counts": [],
        "candidate_rows": args.candidate_rows,
    }
    cases, sparse_cases = result["cases"], result["sparse_reuse_attention"]

    def record(case, requests, context, ours, ideal, case_reps=None):
        cases.append({"case": case, "requests": requests, "context": context, "ours_ms": round(ours, 3),
                      "ideal_ms": round(ideal, 3), "ratio": round(ours / ideal, 3), "reps": case_reps or reps})
        print(f"{case:>10} {requests:>4} x {context:<6} ours {ours:9.2f} ms  ideal {ideal:9.2f} ms  "
              f"ratio {ours / ideal:5.2f}", flush=True)
        save(result, args.out)  # after every case: a crash later keeps what was measured

    if args.only_op_counts:
        result["op_counts"] = op_counts(device, TOY if args.smoke else SMALL)
        print(save(result, args.out))
        return
    for context in [int(c) for c in args.sparse_contexts.split(",") if c]:
        runs = {cache: reuse_attention(model, args.sparse_requests, context, cache, timer, reps, device)
                for cache in ("dual", "sparse")}
        dense, sparse = runs["dual"], runs["sparse"]
        row = {"case": "reuse_attention", "requests": args.sparse_requests, "context": context,
               "retention": SPARSE_RETENTION, "dense": dense, "sparse": sparse,
               "ratio": round(sparse["attn_ms"] / dense["attn_ms"], 3),
               "stream_ratio": round(sparse["attn_stream_ms"] / dense["attn_stream_ms"], 3),
               "ideal_ratio": round(sparse["ideal_sdpa_ms"] / dense["ideal_sdpa_ms"], 3),
               "kv_ratio": round(sparse["seq_len"] / dense["seq_len"], 3)}
        sparse_cases.append(row)
        save(result, args.out)
        print(f"reuse attention {args.sparse_requests} x {context}: dense {dense['attn_ms']:.2f} ms "
              f"(seq {dense['seq_len']}), sparse r={SPARSE_RETENTION} {sparse['attn_ms']:.2f} ms "
              f"(seq {sparse['seq_len']}), ratio {row['ratio']:.3f}; back to back {dense['attn_stream_ms']:.2f} / "
              f"{sparse['attn_stream_ms']:.2f} ms, ratio {row['stream_ratio']:.3f} (ideal SDPA {row['ideal_ratio']:.3f})",
              flush=True)
    if args.only_sparse:
        refresh_contexts, contexts = (), ()
    for context in refresh_contexts:
        record("refresh", 1, context, ours_refresh(model, context, timer, reps, device),
               ideal_refresh(model, context, timer, reps, device))
    def kv_fits_twice(case, requests, context):
        # ours and the ideal each hold the batch's K/V; the GPU must hold both at once
        kv_bytes = 2 * requests * context * shape.num_layers * shape.num_kv_heads * shape.head_dim * 2
        if device.type == "cuda" and 2 * kv_bytes > torch.cuda.mem_get_info()[0] * 0.8:
            print(f"skip {case} {requests} x {context}: KV does not fit twice", flush=True)
            return False
        return True

    for context in contexts:
        for requests in reuse_requests:
            if not kv_fits_twice("reuse", requests, context):
                continue
            record("reuse", requests, context, ours_reuse(model, requests, context, timer, reps, device),
                   ideal_reuse(model, requests, context, timer, reps, device))
    for context in contexts:
        for requests in llada2_requests:
            if not kv_fits_twice("llada2_step", requests, context):
                continue
            record("llada2_step", requests, context, ours_llada2(model, requests, context, timer, reps, device),
                   ideal_reuse(model, requests, context, timer, min(reps, BLOCK - 3), device),
                   case_reps=min(reps, BLOCK - 3))
    if device.type == "cuda" and contexts:
        record("reuse_graphed", 1, contexts[0],
               ours_reuse(model, 1, contexts[0], timer, reps, device, cuda_graphs=True),
               ideal_reuse_graphed(model, 1, contexts[0], timer, reps, device))
    for temperature in () if args.only_sparse else (0.0, 1.0):
        record(f"head_T{temperature:g}", head_requests, BLOCK,
               ours_head(model, head_requests, temperature, timer, reps, device),
               ideal_head(model, head_requests, temperature, timer, reps, device))

    if not args.only_sparse:
        result["op_counts"] = op_counts(device, TOY if args.smoke else SMALL)
    print(save(result, args.out))


if __name__ == "__main__":
    main()
