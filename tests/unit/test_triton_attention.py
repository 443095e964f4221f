"""The Triton paged attention kernel against a naive torch reference.

Without a GPU the kernel runs under Triton's interpreter.  Triton 3.9 reads
TRITON_INTERPRET when `@triton.jit` decorates the kernel, i.e. when
`vllm_dllm.attention.triton_paged` is first imported, not at launch time.  Inside a
pytest process that module may already have been imported (without the flag) by
something else, so the comparisons run in a fresh subprocess (this file run as a
script) with the flag set in its environment; it prints one JSON report and the
tests here check it case by case.  With CUDA present the same script also runs
compiled on the GPU.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
import time
from dataclasses import dataclass

import pytest
import torch

from tests.triton_harness import (
    REPO_ROOT,
    cuda_report_or_skip,
    interpreter_report_or_skip,
    needs_triton,
)

MODULE_PATH = REPO_ROOT / "vllm_dllm" / "attention" / "triton_paged.py"

# Max abs error vs a float64 reference, per dtype (outputs are O(1)).
TOLERANCES = {"float32": 1e-5, "float16": 4e-3, "bfloat16": 2e-2}


@dataclass
class Seq:
    q_len: int
    kv_len: int
    twin_of: int | None = None  # share this sequence's block row, right after its KV
    segment_of: int | None = None  # share this sequence's block row and KV start (a block-causal segment)


@dataclass
class Case:
    name: str
    dtype: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    seqs: list[Seq]
    block_m: int | None = 16
    block_n: int | None = 16
    strided_q: bool = False  # q as a view into a wider qkv buffer
    seed: int = 0


CASES = [
    Case(
        "block_causal_segments_f32",
        "float32",
        4,
        2,
        16,
        16,
        # LLaDA2 steps cut into per-block segments over one request's row: a prefill
        # of three blocks of 8 and a boundary step (finished block + active block).
        [Seq(8, 8), Seq(8, 16, segment_of=0), Seq(8, 24, segment_of=0),
         Seq(8, 40), Seq(8, 48, segment_of=3)],
        seed=7,
    ),
    Case(
        "gqa_f32_bs16_twin",
        "float32",
        4,
        2,
        16,
        16,
        # ragged: a twin at a non-aligned kv_start, a single query, a query tile
        # split over two BLOCK_M tiles, a sequence with no query rows this step
        [Seq(7, 37), Seq(7, 37, twin_of=0), Seq(1, 16), Seq(20, 20), Seq(0, 9)],
        strided_q=True,
    ),
    Case(
        "mha_f32_bs32_twin",
        "float32",
        2,
        2,
        32,
        32,
        [Seq(3, 45), Seq(17, 70), Seq(3, 45, twin_of=0)],
        block_n=32,
        seed=1,
    ),
    Case(
        "mqa_f32_bs16_tile32",
        "float32",
        4,
        1,
        16,
        16,
        # KV tiles of 32 straddle pool blocks of 16 and the twin's offset
        [Seq(5, 26), Seq(2, 26, twin_of=0), Seq(9, 50)],
        block_n=32,
        seed=2,
    ),
    Case(
        "gqa_f32_default_tiles",
        "float32",
        4,
        2,
        16,
        32,
        [Seq(11, 75), Seq(4, 30), Seq(4, 30, twin_of=1)],
        block_m=None,
        block_n=None,
        seed=3,
    ),
    Case(
        "gqa_bf16_bs32_twin",
        "bfloat16",
        4,
        2,
        32,
        32,
        [Seq(6, 41), Seq(6, 41, twin_of=0), Seq(18, 33), Seq(1, 64)],
        strided_q=True,
        seed=4,
    ),
    Case(
        "mha_bf16_bs16",
        "bfloat16",
        2,
        2,
        16,
        16,
        [Seq(9, 29), Seq(3, 50), Seq(3, 50, twin_of=1)],
        block_n=32,
        seed=5,
    ),
    Case(
        # LLaDA-8B's head width in bf16 with the default tiles: on a Hopper GPU the
        # 128-position KV tile at 3 stages, over ragged lengths and a twin
        "mha_bf16_d128_default_tiles",
        "bfloat16",
        2,
        2,
        128,
        16,
        [Seq(32, 300), Seq(32, 300, twin_of=0), Seq(5, 129)],
        block_m=None,
        block_n=None,
        seed=8,
    ),
    Case(
        "gqa_f16_bs16",
        "float16",
        4,
        2,
        16,
        16,
        [Seq(4, 23), Seq(4, 23, twin_of=0), Seq(12, 12)],
        seed=6,
    ),
]


def build_inputs(case: Case, device: str):
    """Random pool, shuffled block tables and packed queries for `case`.

    Pool slots no sequence uses are NaN, and block-table padding points at an
    all-NaN block, so a kernel that reads (or fails to mask) anything beyond a
    sequence's KV produces NaN.
    """
    gen = torch.Generator().manual_seed(case.seed)
    dtype = getattr(torch, case.dtype)
    bs, hkv, d, h = case.block_size, case.num_kv_heads, case.head_dim, case.num_heads

    # Logical length of each block-table row (a twin extends its partner's row).
    kv_start = [0] * len(case.seqs)
    row_of = list(range(len(case.seqs)))
    row_len = {}
    for s, seq in enumerate(case.seqs):
        if seq.segment_of is not None:
            row_of[s] = seq.segment_of
            row_len[seq.segment_of] = max(row_len[seq.segment_of], seq.kv_len)
        elif seq.twin_of is None:
            row_len[s] = seq.kv_len
        else:
            p = case.seqs[seq.twin_of]
            assert p.twin_of is None
            row_of[s] = seq.twin_of
            kv_start[s] = kv_start[seq.twin_of] + p.kv_len
            row_len[seq.twin_of] = max(row_len[seq.twin_of], kv_start[s] + seq.kv_len)
    blocks_per_row = {r: math.ceil(n / bs) for r, n in row_len.items()}
    max_blocks = max(blocks_per_row.values()) + 2  # padding columns
    num_blocks = sum(blocks_per_row.values()) + 3  # spare blocks stay NaN
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    nan_block = perm.pop()

    kv_cache = torch.full((num_blocks, bs, 2, hkv, d), float("nan"), dtype=torch.float32)
    rows = {}
    for r, nb in blocks_per_row.items():
        blocks = [perm.pop() for _ in range(nb)]
        rows[r] = blocks + [nan_block] * (max_blocks - nb)
        for i in range(row_len[r]):
            kv_cache[blocks[i // bs], i % bs] = torch.randn(2, hkv, d, generator=gen)
    block_table = torch.tensor([rows[row_of[s]] for s in range(len(case.seqs))], dtype=torch.int32)

    q_lens = [seq.q_len for seq in case.seqs]
    total = sum(q_lens)
    if case.strided_q:  # q = first third of a packed [T, 3 * H * D] qkv projection
        qkv = torch.randn(total, 3 * h * d, generator=gen)
        q = qkv.to(dtype)[:, : h * d].view(total, h, d)
        assert not q.is_contiguous()
    else:
        q = torch.randn(total, h, d, generator=gen).to(dtype)
    query_start_loc = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    seq_lens = torch.tensor([seq.kv_len for seq in case.seqs], dtype=torch.int32)
    kv_start_t = torch.tensor(kv_start, dtype=torch.int32)

    args = dict(
        q=q,
        kv_cache=kv_cache.to(dtype),
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        kv_start=kv_start_t,
        block_table=block_table,
        max_query_len=max(q_lens),
        scale=d**-0.5,
    )
    on_device = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    if case.strided_q:  # a copy to the device is contiguous: slice the device's own qkv
        on_device["q"] = qkv.to(device, dtype)[:, : h * d].view(total, h, d)
        assert not on_device["q"].is_contiguous()
    return on_device


def reference(q, kv_cache, query_start_loc, seq_lens, kv_start, block_table, max_query_len, scale):
    """Naive per-sequence loop in float64: gather K/V slot by slot, then SDPA."""
    num_heads, num_kv_heads = q.shape[1], kv_cache.shape[3]
    bs = kv_cache.shape[1]
    pool = kv_cache.double().flatten(0, 1)  # [num_slots, 2, H_kv, D]
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for s in range(seq_lens.shape[0]):
        q0, q1 = int(query_start_loc[s]), int(query_start_loc[s + 1])
        if q1 == q0:
            continue
        idx = int(kv_start[s]) + torch.arange(int(seq_lens[s]), device=q.device)
        slots = block_table[s, idx // bs].long() * bs + idx % bs
        k = pool[slots, 0].transpose(0, 1).repeat_interleave(num_heads // num_kv_heads, 0)
        v = pool[slots, 1].transpose(0, 1).repeat_interleave(num_heads // num_kv_heads, 0)
        qs = q[q0:q1].double().transpose(0, 1)
        out[q0:q1] = torch.nn.functional.scaled_dot_product_attention(qs, k, v, scale=scale).transpose(0, 1)
    return out


def _validation_errors(paged_attention_triton, device: str) -> list[str]:
    """Bad inputs must be refused before launch; returns what was not."""
    case = CASES[0]
    good = build_inputs(case, device)
    bad = {
        "int64 metadata": dict(seq_lens=good["seq_lens"].long()),
        "dtype mismatch": dict(q=good["q"].double()),
        "heads not a multiple": dict(q=good["q"][:, :3]),
        "head_dim not pow2": dict(q=good["q"][..., :12], kv_cache=good["kv_cache"][..., :12]),
    }
    missed = []
    for what, override in bad.items():
        try:
            paged_attention_triton(**{**good, **override})
        except AssertionError:
            continue
        missed.append(what)
    return missed


def run_cases(device: str) -> dict:
    """Script side: every case's error and time, plus run facts, as a dict."""
    from triton.runtime.interpreter import InterpretedFunction

    from vllm_dllm.attention import triton_paged

    report = {
        "interpreted": isinstance(triton_paged._paged_attn_fwd, InterpretedFunction),
        "validation_missed": _validation_errors(triton_paged.paged_attention_triton, device),
        "cases": {},
    }
    for case in CASES:
        args = build_inputs(case, device)
        t0 = time.perf_counter()
        out = triton_paged.paged_attention_triton(**args, block_m=case.block_m, block_n=case.block_n)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        ref = reference(**args)
        err = (out.double() - ref).abs().max().item() if out.numel() else 0.0
        report["cases"][case.name] = {
            "max_abs_err": err if math.isfinite(err) else str(err),
            "tol": TOLERANCES[case.dtype],
            "ok": math.isfinite(err) and err <= TOLERANCES[case.dtype],
            "shape_ok": out.shape == args["q"].shape and out.dtype == args["q"].dtype,
            "seconds": round(seconds, 3),
        }
    return report


@pytest.fixture(scope="module")
def interpreter_report():
    return interpreter_report_or_skip(__file__)


@pytest.fixture(scope="module")
def cuda_report():
    return cuda_report_or_skip(__file__)


@needs_triton
def test_interpreter_is_really_used(interpreter_report):
    assert interpreter_report["interpreted"]


@needs_triton
def test_bad_inputs_refused(interpreter_report):
    assert interpreter_report["validation_missed"] == []


@needs_triton
@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_matches_reference_interpreter(interpreter_report, name):
    r = interpreter_report["cases"][name]
    assert r["shape_ok"]
    assert r["ok"], f"{name}: max abs err {r['max_abs_err']} > {r['tol']}"


@needs_triton
def test_bad_inputs_refused_cuda(cuda_report):
    assert not cuda_report["interpreted"]
    assert cuda_report["validation_missed"] == []


@needs_triton
@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_matches_reference_cuda(cuda_report, name):
    r = cuda_report["cases"][name]
    assert not cuda_report["interpreted"]
    assert r["shape_ok"]
    assert r["ok"], f"{name}: max abs err {r['max_abs_err']} > {r['tol']}"


def test_imports_without_triton(monkeypatch):
    """The module loads (under a private name) with triton absent; calls raise."""
    for mod in ("triton", "triton.language"):
        monkeypatch.setitem(sys.modules, mod, None)  # makes `import triton` raise ImportError
    spec = importlib.util.spec_from_file_location("_triton_paged_without_triton", MODULE_PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.HAS_TRITON is False
    with pytest.raises(RuntimeError, match="triton"):
        mod.paged_attention_triton(*([None] * 6), 1, 1.0)


@pytest.mark.parametrize(
    ("head_dim", "element_size", "wide_kv_tile", "expected"),
    [
        (128, 2, True, (32, 128, 3)),  # the tile the H100 sweep picked
        (128, 2, False, (32, 64, None)),  # not a Hopper GPU, or the interpreter
        (64, 2, True, (32, 64, None)),  # only the measured row width goes wide
        (128, 4, True, (32, 32, None)),  # float32 rows of 512 bytes
        (128, 4, False, (32, 32, None)),
    ],
)
def test_default_tiles(head_dim, element_size, wide_kv_tile, expected):
    from vllm_dllm.attention import triton_paged

    assert triton_paged.default_block_sizes(head_dim, 32, element_size, wide_kv_tile) == expected


def test_no_wide_tile_off_the_gpu():
    from vllm_dllm.attention import triton_paged

    assert not triton_paged._wide_kv_tile(torch.device("cpu"))


def test_default_query_tile_follows_the_longest_query_run():
    from vllm_dllm.attention import triton_paged

    assert [triton_paged.default_block_sizes(128, n)[0] for n in (1, 16, 17, 32, 64, 200)] == [16, 16, 32, 32, 64, 64]


def test_reference_matches_dense_attention():
    """Sanity of the reference itself: one sequence in contiguous blocks, MHA."""
    torch.manual_seed(0)
    h, d, bs, n = 2, 16, 16, 40
    kv = torch.randn(3, bs, 2, h, d, dtype=torch.float64)
    q = torch.randn(5, h, d, dtype=torch.float64)
    k = kv[:, :, 0].reshape(-1, h, d)[:n]
    v = kv[:, :, 1].reshape(-1, h, d)[:n]
    scores = torch.einsum("qhd,khd->hqk", q, k) * d**-0.5
    dense = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    got = reference(
        q,
        kv,
        torch.tensor([0, 5], dtype=torch.int32),
        torch.tensor([n], dtype=torch.int32),
        torch.tensor([0], dtype=torch.int32),
        torch.tensor([[0, 1, 2]], dtype=torch.int32),
        5,
        d**-0.5,
    )
    torch.testing.assert_close(got, dense)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    report = run_cases(parser.parse_args().device)
    print(json.dumps(report))
    bad = report["validation_missed"] or [n for n, r in report["cases"].items() if not (r["ok"] and r["shape_ok"])]
    sys.exit(1 if bad else 0)
