"""Philox4x32-10 draws (vllm_dllm.decoding.philox) and their Triton twin.

* Known answers from Random123's tests/kat_vectors, and a plain-Python scalar
  implementation of the contract (written here from the module docstring, Python
  ints only) checked against the vectorised torch code.
* Properties: distinct (seed, step, position, stream) give distinct draws; a row's
  draws do not depend on the other rows of the batch or on chunking.
* Triton: `uniform_rows_triton` bit-identical to `uniform_rows`.  Triton 3.9 reads
  TRITON_INTERPRET when `@triton.jit` decorates a kernel, i.e. when
  `vllm_dllm.decoding.triton_philox` is first imported; inside a pytest process that
  module may already have been imported without the flag, so the Triton checks run
  in a fresh subprocess (this file run as a script) with the flag set, which prints
  one JSON report that the tests here read case by case.  With CUDA present the
  script also runs compiled on the GPU.
"""

from __future__ import annotations

import importlib.util
import json
import random
import struct
import sys

import pytest
import torch

from tests.triton_harness import (
    REPO_ROOT,
    cuda_report_or_skip,
    needs_triton,
    run_script,
)
from vllm_dllm.decoding import philox
from vllm_dllm.decoding.philox import philox4x32_10, uniform, uniform_rows

TRITON_MODULE_PATH = REPO_ROOT / "vllm_dllm" / "decoding" / "triton_philox.py"

MASK32 = 0xFFFFFFFF

# Random123 tests/kat_vectors, the three "philox4x32 10" lines: counter, key, output.
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    (
        (MASK32, MASK32, MASK32, MASK32),
        (MASK32, MASK32),
        (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD),
    ),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


# ---- the contract in plain Python -------------------------------------------------


def py_philox(ctr, key):
    c0, c1, c2, c3 = ctr
    k0, k1 = key
    for r in range(10):
        if r:
            k0 = (k0 + 0x9E3779B9) & MASK32
            k1 = (k1 + 0xBB67AE85) & MASK32
        p0 = 0xD2511F53 * c0
        p1 = 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & MASK32, (p0 >> 32) ^ c3 ^ k1, p0 & MASK32
    return c0, c1, c2, c3


def py_f32(x: float) -> float:
    """Round a double to the nearest float32 (ties to even), back as a double."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def py_to_uniform(x0: int, x1: int, f64: bool) -> float:
    if f64:
        m = (x0 << 21) | (x1 >> 11)
        return min((m + 0.5) * 2.0**-53, 1.0 - 2.0**-53)  # m + 0.5: one RNE rounding
    m = x0 >> 8
    return min(py_f32((m + 0.5) * 2.0**-24), 1.0 - 2.0**-24)  # exact in double, then RNE


def py_uniform(seed: int, step: int, position: int, stream: int, index: int, f64: bool) -> float:
    s = seed % 2**64
    x = py_philox((index, position % 2**32, step % 2**32, stream % 2**32), (s % 2**32, s >> 32))
    return py_to_uniform(x[0], x[1], f64)


def _rows(seeds, steps, positions):
    return (torch.tensor(seeds, dtype=torch.int64), torch.tensor(steps), torch.tensor(positions))


# ---- Philox itself -------------------------------------------------------------------


def test_known_answer_vectors():
    ctr = torch.tensor([c for c, _, _ in KAT], dtype=torch.int64)
    key = torch.tensor([k for _, k, _ in KAT], dtype=torch.int64)
    out = philox4x32_10(ctr, key)
    assert out.dtype == torch.int64 and out.shape == (3, 4)
    assert [tuple(r) for r in out.tolist()] == [o for _, _, o in KAT]
    assert [py_philox(c, k) for c, k, _ in KAT] == [o for _, _, o in KAT]


def test_philox_broadcasts_over_leading_dims():
    ctr = torch.tensor([c for c, _, _ in KAT], dtype=torch.int64)
    key = torch.tensor(KAT[2][1], dtype=torch.int64)  # one key for all counters
    out = philox4x32_10(ctr[:, None, :], key[None, None, :].expand(1, 2, 2))
    assert out.shape == (3, 2, 4)
    for i, (c, _, _) in enumerate(KAT):
        assert tuple(out[i, 1].tolist()) == py_philox(c, KAT[2][1])


def test_int64_product_keeps_exact_low_64_bits():
    """The 32x32 -> 64 product wraps in int64 (the trick philox.py relies on); the
    high and low words must still be exact."""
    rng = random.Random(1)
    vals = [0, 1, MASK32, MASK32 - 1, 1 << 31, (1 << 31) - 1] + [rng.getrandbits(32) for _ in range(500)]
    a = torch.tensor(vals, dtype=torch.int64)
    for m in (philox.M0, philox.M1):
        p = a * m
        assert ((p >> 32) & MASK32).tolist() == [(v * m) >> 32 for v in vals]
        assert (p & MASK32).tolist() == [(v * m) & MASK32 for v in vals]
        p = a.clone()
        p *= m  # in place, as in the rounds
        assert ((p >> 32) & MASK32).tolist() == [(v * m) >> 32 for v in vals]


def test_philox_matches_python_on_random_words():
    rng = random.Random(2)
    words = [[rng.choice([0, MASK32, rng.getrandbits(32)]) for _ in range(6)] for _ in range(200)]
    ctr = torch.tensor([w[:4] for w in words], dtype=torch.int64)
    key = torch.tensor([w[4:] for w in words], dtype=torch.int64)
    got = [tuple(r) for r in philox4x32_10(ctr, key).tolist()]
    assert got == [py_philox(w[:4], w[4:]) for w in words]


# ---- the draw contract -----------------------------------------------------------------

SEEDS = [0, 1, 2**32 - 1, 2**32, 2**40 + 12345, 2**63 - 1, 987654321987654321, -5]
STEPS = [0, 1, -1, 7, 2**31, 3, 1000, 12]
POSITIONS = [0, -1, 5, 2**32 + 3, 63, -1, 1, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("stream", [0, 1, 5, 2**32 - 1])
def test_uniform_rows_matches_python_contract(dtype, stream):
    n = 11
    got = uniform_rows(*_rows(SEEDS, STEPS, POSITIONS), stream, n, dtype)
    assert got.dtype == dtype and got.shape == (len(SEEDS), n)
    f64 = dtype == torch.float64
    want = [
        [py_uniform(s, t, p, stream, i, f64) for i in range(n)] for s, t, p in zip(SEEDS, STEPS, POSITIONS)
    ]
    assert got.tolist() == want


def test_random_rows_match_python_contract():
    rng = random.Random(3)
    rows = 16
    seeds = [rng.getrandbits(63) for _ in range(rows)]
    steps = [rng.randrange(-1, 2000) for _ in range(rows)]
    positions = [rng.randrange(-1, 4096) for _ in range(rows)]
    for dtype in (torch.float32, torch.float64):
        got = uniform_rows(*_rows(seeds, steps, positions), 1, 9, dtype).tolist()
        for r in range(rows):
            want = [py_uniform(seeds[r], steps[r], positions[r], 1, i, dtype == torch.float64) for i in range(9)]
            assert got[r] == want, r


def test_uniform_is_index_zero():
    args = _rows(SEEDS, STEPS, POSITIONS)
    for dtype in (torch.float32, torch.float64):
        one = uniform(*args, 4, dtype)
        assert one.shape == (len(SEEDS),) and one.dtype == dtype
        assert torch.equal(one, uniform_rows(*args, 4, 5, dtype)[:, 0])


def test_conversion_edges_stay_inside_the_open_interval():
    """Extreme words: the largest m would round to 1.0 and is clamped just below it."""
    pairs = [
        (0, 0),
        (0xFF, 0x7FF),
        (MASK32, MASK32),
        (MASK32 - 0xFF, 0),  # f32: m = 2**24 - 1 (would round to 1.0)
        (MASK32 - 0x1FF, MASK32),  # f32: m = 2**24 - 2
        (1 << 31, 0),  # m = 2**23 / 2**52
        ((1 << 31) | 0x100, 0x800),  # odd m in the upper half: + 0.5 is a tie
        ((1 << 31) | 0x200, 0x1000),
    ]
    x0 = torch.tensor([p[0] for p in pairs], dtype=torch.int64)
    x1 = torch.tensor([p[1] for p in pairs], dtype=torch.int64)
    for dtype, f64 in ((torch.float32, False), (torch.float64, True)):
        u = philox._to_uniform((x0, x1), dtype)
        assert u.tolist() == [py_to_uniform(a, b, f64) for a, b in pairs]
        assert bool((u > 0).all()) and bool((u < 1).all())
    u32 = philox._to_uniform((x0, x1), torch.float32).tolist()
    u64 = philox._to_uniform((x0, x1), torch.float64).tolist()
    assert u32[0] == 2.0**-25 and u32[2] == 1 - 2.0**-24 and u32[3] == 1 - 2.0**-24
    assert u64[0] == 2.0**-54 and u64[2] == 1 - 2.0**-53


def test_bad_dtype_refused():
    with pytest.raises(ValueError, match="dtype"):
        uniform_rows(*_rows([1], [0], [0]), 1, 4, torch.float16)


# ---- properties --------------------------------------------------------------------------


def test_distinct_inputs_give_distinct_draws():
    base = (2**40 + 7, 3, 5, 1)
    variants = [base]
    for field, values in enumerate(
        [
            [0, 1, 2**32, 2**40 + 8, (2**40 + 7) ^ (1 << 32), 2**63 - 1],  # seed, incl. high word only
            [0, 4, -1, 2**16 + 3],  # step
            [0, 4, -1, 6, 2**16 + 5],  # position
            [0, 2, 3, 4, 5],  # stream
        ]
    ):
        for v in values:
            t = list(base)
            t[field] = v
            variants.append(tuple(t))
    # the key/counter words must not alias: (step, position) swapped differs
    variants.append((base[0], base[2], base[1], base[3]))
    rows = []
    for seed, step, pos, stream in variants:
        rows.append(uniform_rows(*_rows([seed], [step], [pos]), stream, 8, torch.float64)[0])
    draws = torch.stack(rows)
    assert len(set(map(tuple, draws.tolist()))) == len(variants)
    # and within a row, every index gives a different draw
    assert all(len(set(r)) == 8 for r in draws.tolist())
    # a wider random set: first draws all distinct (53-bit values)
    rng = random.Random(4)
    seeds = [rng.getrandbits(63) for _ in range(400)]
    steps = [rng.randrange(0, 64) for _ in range(400)]
    positions = [rng.randrange(-1, 64) for _ in range(400)]
    first = uniform(*_rows(seeds, steps, positions), 1, torch.float64)
    assert len(set(first.tolist())) == len(set(zip(seeds, steps, positions))) == 400


def test_rows_do_not_depend_on_the_batch(monkeypatch):
    rng = random.Random(5)
    rows = 12
    seeds = torch.tensor([rng.getrandbits(63) for _ in range(rows)])
    steps = torch.tensor([rng.randrange(-1, 50) for _ in range(rows)])
    positions = torch.tensor([rng.randrange(-1, 50) for _ in range(rows)])
    for dtype in (torch.float32, torch.float64):
        full = uniform_rows(seeds, steps, positions, 2, 50, dtype)
        perm = torch.randperm(rows, generator=torch.Generator().manual_seed(0))
        assert torch.equal(uniform_rows(seeds[perm], steps[perm], positions[perm], 2, 50, dtype), full[perm])
        sub = torch.tensor([7, 2])
        assert torch.equal(uniform_rows(seeds[sub], steps[sub], positions[sub], 2, 50, dtype), full[sub])
        alone = torch.stack(
            [uniform_rows(seeds[r : r + 1], steps[r : r + 1], positions[r : r + 1], 2, 50, dtype)[0] for r in range(rows)]
        )
        assert torch.equal(alone, full)
        # a shorter row is a prefix of the longer one
        assert torch.equal(uniform_rows(seeds, steps, positions, 2, 13, dtype), full[:, :13])
        # column chunking does not change the bits
        monkeypatch.setattr(philox, "_CHUNK_ELEMENTS", 7 * rows)
        assert torch.equal(uniform_rows(seeds, steps, positions, 2, 50, dtype), full)
        monkeypatch.undo()


def test_uniform_statistics():
    seeds = torch.arange(200, dtype=torch.int64) * 1000003
    zeros = torch.zeros(200, dtype=torch.int64)
    for dtype in (torch.float32, torch.float64):
        u = uniform_rows(seeds, zeros, zeros - 1, 1, 1000, dtype).double().flatten()
        assert bool((u > 0).all()) and bool((u < 1).all())
        assert abs(u.mean().item() - 0.5) < 0.003  # sd of the mean ~ 0.00065
        assert abs(u.var().item() - 1 / 12) < 0.002
        counts = torch.histc(u, bins=20, min=0, max=1)
        assert ((counts - 10000).abs() < 600).all(), counts  # sd ~ 97


# ---- Triton -------------------------------------------------------------------------

TRITON_CASES = [
    "uniform_f32_ragged",
    "uniform_f64_ragged",
    "uniform_default_block",
    "uniform_single_draw",
    "conversion_edges",
]


def run_triton_cases(device: str) -> dict:
    """Runs in the subprocess: Triton against the torch reference on `device`."""
    global tp  # a global, so the test kernel below can call tp's @triton.jit helpers
    import triton
    import triton.language as tl

    from vllm_dllm.decoding import triton_philox as tp

    dev = torch.device(device)
    report = {"interpreted": type(tp._uniform_rows_kernel).__name__ == "InterpretedFunction", "cases": {}}

    def check(name, fn):
        try:
            ok, detail = fn()
        except Exception as exc:  # report, do not crash the whole script
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        report["cases"][name] = {"ok": bool(ok), "detail": str(detail)[:2000]}

    rows = [
        torch.tensor(SEEDS[:3], dtype=torch.int64, device=dev),
        torch.tensor(STEPS[:3], dtype=torch.int64, device=dev),
        torch.tensor(POSITIONS[:3], dtype=torch.int64, device=dev),
    ]

    def uniform_case(dtype, n, block, stream, args=rows):
        def fn():
            got = tp.uniform_rows_triton(*args, stream, n, dtype, block=block)
            want = uniform_rows(*args, stream, n, dtype)
            bad = (got != want).nonzero().tolist()
            return got.dtype == dtype and got.shape == want.shape and not bad, f"mismatches at {bad[:10]}"

        return fn

    check("uniform_f32_ragged", uniform_case(torch.float32, 37, 16, 3))
    check("uniform_f64_ragged", uniform_case(torch.float64, 37, 16, 2**32 - 1))
    all_rows = _rows(SEEDS, STEPS, POSITIONS)
    all_rows = [t.to(dev) for t in all_rows]

    def default_block():
        oks = []
        for dtype in (torch.float32, torch.float64):
            got = tp.uniform_rows_triton(*all_rows, 1, 1500, dtype)
            oks.append(torch.equal(got, uniform_rows(*all_rows, 1, 1500, dtype)))
        return all(oks), oks

    check("uniform_default_block", default_block)
    check("uniform_single_draw", uniform_case(torch.float32, 1, None, 2, all_rows))

    @triton.jit
    def _convert(x0_ptr, x1_ptr, o32_ptr, o64_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        x0 = tl.load(x0_ptr + offs, mask=mask).to(tl.uint32)
        x1 = tl.load(x1_ptr + offs, mask=mask).to(tl.uint32)
        tl.store(o32_ptr + offs, tp._uniform32(x0), mask=mask)
        tl.store(o64_ptr + offs, tp._uniform64(x0, x1), mask=mask)

    def conversion_edges():
        pairs = [(0, 0), (MASK32, MASK32), (MASK32 - 0xFF, 0), (MASK32 - 0x1FF, MASK32), ((1 << 31) | 0x100, 0x800)]
        rng = random.Random(6)
        pairs += [(rng.getrandbits(32), rng.getrandbits(32)) for _ in range(27)]
        x0 = torch.tensor([p[0] for p in pairs], dtype=torch.int64, device=dev)
        x1 = torch.tensor([p[1] for p in pairs], dtype=torch.int64, device=dev)
        o32 = torch.empty(len(pairs), dtype=torch.float32, device=dev)
        o64 = torch.empty(len(pairs), dtype=torch.float64, device=dev)
        _convert[(1,)](x0, x1, o32, o64, len(pairs), BLOCK=64)
        w32 = philox._to_uniform((x0, x1), torch.float32)
        w64 = philox._to_uniform((x0, x1), torch.float64)
        return torch.equal(o32, w32) and torch.equal(o64, w64), (o32[:5].tolist(), o64[:5].tolist())

    check("conversion_edges", conversion_edges)

    return report


@pytest.fixture(scope="module")
def interpreter_report():
    return run_script(__file__, "cpu", interpret=True)


@pytest.fixture(scope="module")
def cuda_report():
    return cuda_report_or_skip(__file__)


@needs_triton
def test_triton_interpreter_is_really_used(interpreter_report):
    assert interpreter_report["interpreted"]
    assert sorted(interpreter_report["cases"]) == sorted(TRITON_CASES)


@needs_triton
@pytest.mark.parametrize("name", TRITON_CASES)
def test_triton_matches_torch_interpreter(interpreter_report, name):
    r = interpreter_report["cases"][name]
    assert r["ok"], f"{name}: {r['detail']}"


@needs_triton
@pytest.mark.parametrize("name", TRITON_CASES)
def test_triton_matches_torch_cuda(cuda_report, name):
    assert not cuda_report["interpreted"]
    r = cuda_report["cases"][name]
    assert r["ok"], f"{name}: {r['detail']}"


def test_triton_module_imports_without_triton(monkeypatch):
    """The module loads (under a private name) with triton absent; calls raise."""
    for mod in ("triton", "triton.language"):
        monkeypatch.setitem(sys.modules, mod, None)  # makes `import triton` raise ImportError
    spec = importlib.util.spec_from_file_location("_triton_philox_without_triton", TRITON_MODULE_PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.HAS_TRITON is False
    with pytest.raises(RuntimeError, match="triton"):
        mod.uniform_rows_triton(*_rows([1], [0], [0]), 1, 4, torch.float32)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    report = run_triton_cases(parser.parse_args().device)
    print(json.dumps(report))
    sys.exit(0 if all(r["ok"] for r in report["cases"].values()) else 1)
