"""Start-up self-check of the CUDA paths against their torch references.  Imports no vLLM.

On CUDA the engine attends with the Triton or flash-attention backend, replays Reuse
steps from CUDA graphs and draws its random numbers with the Triton Philox kernel;
on a CPU the torch backend and torch Philox, the references, do all of it.  At
warm-up (worker/gpu_worker.py -> DiffusionModelRunner.self_check) this module runs
the CUDA paths once on the served model and compares:

* Attention and graphs.  A scratch engine with the chosen backend and graphs takes
  three probe requests (a dual-cache one, the same with a CFG twin, a sparse one;
  those the model's family accepts) on free blocks of the real KV pool and runs
  each group for four steps: Refresh, then Reuse steps, graph-captured and
  replayed.  Every forward is repeated with the torch backend, eagerly, on the same
  inputs and the same pool, and the hidden states are compared.
* Whole-step graphs.  The probes run their canvases to the end in calls of several
  steps, with the later steps replayed from whole-step graphs and without: the
  canvases must be identical (the same kernels on the same inputs).
* Philox.  `uniform_rows_triton` against `philox.uniform_rows`, float32 and
  float64, over seeds, steps, positions and streams at their edges: bit-exact by
  contract.

What fails is logged as an ERROR naming it.  The runner then serves with the torch
backend without graphs (refusing to start instead when the user forced the
backend), without whole-step graphs, or sampling draws with the torch Philox.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from vllm_dllm.attention.backends import TorchAttention
from vllm_dllm.attention.metadata import attention_metadata
from vllm_dllm.decoding import philox
from vllm_dllm.engine.engine import StepEngine
from vllm_dllm.log import get_logger
from vllm_dllm.options import OptionError, resolve, sequence_copies
from vllm_dllm.scheduler.track import RequestTrack

logger = get_logger(__name__)

# Largest relative error allowed, per model dtype: the maximum over query rows of
# ||candidate - reference|| / ||reference|| for the hidden states a forward returns
# (every layer, so per-layer differences compound over the depth, ~32 layers).
#   float32   both sides compute in IEEE float32 (the Triton kernel's dots use
#             input_precision="ieee"); they differ only in summation order, ~1e-6
#             per layer, so 1e-3 leaves two orders of margin.
#   float16   each layer rounds its attention output to 11 bits (unit roundoff
#             2**-11 = 4.9e-4); two correct kernels round differently, ~32 x 4.9e-4
#             = 1.6e-2 at worst: 2e-2.
#   bfloat16  8 bits (2**-8 = 3.9e-3): the same compounding reaches ~0.06-0.12 in
#             the worst case, ~1-2% typically: 1e-1.
# A wrong kernel (a key block missed or read twice, a CFG twin's offset ignored, a
# stale graph buffer) changes whole attention rows: errors of order 0.3-1.
TOLERANCES = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 1e-1}

PROBE_GEN = 32  # canvas of each probe request
PROBE_BLOCK = 8
PROBE_PROMPT = 24
STEPS_PER_GROUP = 4  # Refresh, then Reuse steps (a sparse request may refresh twice)
MAX_CALLS = 4 * PROBE_GEN  # the whole-step check's calls per run (a canvas takes at most PROBE_GEN)
PROBES = {
    "dual cache": {"cache": "dual", "block_length": PROBE_BLOCK, "steps": PROBE_GEN},
    "CFG twin": {"cache": "dual", "block_length": PROBE_BLOCK, "steps": PROBE_GEN, "cfg_scale": 1.0},
    "sparse cache": {"cache": "sparse", "block_length": PROBE_BLOCK, "steps": PROBE_GEN, "retention": 0.5},
}


@dataclass
class CheckResult:
    name: str  # what was checked, as the log names it
    ok: bool
    error: float = 0.0
    tolerance: float = 0.0
    detail: str = ""
    reference: str = "its torch reference"

    def __str__(self) -> str:
        if self.detail.startswith("not run"):
            return f"{self.name}: {self.detail}"
        verdict = "agrees with" if self.ok else "DISAGREES with"
        return f"{self.name} {verdict} {self.reference}: {self.detail}"


def relative_error(candidate: torch.Tensor, reference: torch.Tensor) -> float:
    """Max over rows of ||candidate - reference|| / ||reference|| (float32)."""
    candidate, reference = candidate.float().flatten(1), reference.float().flatten(1)
    if candidate.shape != reference.shape:
        return float("inf")
    if not len(reference):
        return 0.0
    diff = torch.linalg.vector_norm(candidate - reference, dim=1)
    scale = torch.linalg.vector_norm(reference, dim=1).clamp(min=1e-6)
    error = (diff / scale).max()
    return float("inf") if not torch.isfinite(error) else float(error)


class _CheckedEngine(StepEngine):
    """A step engine that repeats each forward with the reference backend, eagerly,
    on the same inputs and pool (first, so the candidate's K/V stay in the pool)."""

    def __init__(self, *args, reference_backend, **kwargs):
        super().__init__(*args, **kwargs)
        self.reference_backend = reference_backend
        self.records: list[tuple[str, torch.Tensor, torch.Tensor]] = []

    def _forward(self, batch, inputs):
        meta = inputs.metadata
        ref_meta = replace(meta, backend=self.reference_backend)
        if meta.cache_fill is not None:
            ref_meta.cache_fill = replace(meta.cache_fill,
                                          meta=replace(meta.cache_fill.meta, backend=self.reference_backend))
        with attention_metadata(ref_meta), self.model_context(len(inputs.input_ids)):
            reference = self.model(inputs.input_ids, inputs.positions).clone()
        graphs = len(self.graphs.graphs) if self.graphs is not None else 0
        hidden = super()._forward(batch, inputs)
        if self.graphs is not None and len(self.graphs.graphs) > graphs:
            phase = "Reuse, graph captured"
        elif batch.refresh.any():
            phase = "Refresh"
        elif self.graphs is not None and self.graphs.key(batch.sequences.num_queries, batch.refresh,
                                                          meta.has_kv_offset) in self.graphs.graphs:
            phase = "Reuse, graph replayed"
        else:
            phase = "Reuse"
        self.records.append((phase, hidden.clone(), reference))
        return hidden


def probe_options(defaults) -> dict:
    """The probes the served family accepts ({name: DecodeOptions}); its default
    decoding when it accepts none of them."""
    options = {}
    for name, extra in PROBES.items():
        try:
            options[name] = resolve(defaults, max_tokens=PROBE_GEN, temperature=0.0, top_p=1.0, top_k=0,
                                    extra_args=extra)
        except OptionError:
            continue
    if not options:
        options["default decoding"] = resolve(defaults, max_tokens=PROBE_GEN, temperature=0.0, top_p=1.0, top_k=0,
                                              extra_args={})
    return options


def check_attention(
    engine_kwargs: dict,
    probes: dict,
    *,
    num_blocks: int,
    vocab_size: int,
    dtype: torch.dtype,
    first_block: int = 1,
) -> CheckResult:
    """The backend (and graphs) of `engine_kwargs` against the torch backend.

    `engine_kwargs`: StepEngine's arguments as the runner builds its engine (the
    model's layers bound to a pool of `num_blocks` blocks, block 0 the null block);
    the probes take blocks from `first_block` on.  `probes`: {name: DecodeOptions}."""
    backend = engine_kwargs["backend"]
    graphs = bool(engine_kwargs.get("cuda_graphs"))
    name = f"attention backend {backend.name!r}" + (" with CUDA graphs" if graphs else "")
    tolerance = TOLERANCES.get(dtype, TOLERANCES[torch.float32])
    engine = _CheckedEngine(**{**engine_kwargs, "capacity": len(probes)}, reference_backend=TorchAttention())
    groups = _add_probes(engine, probes, vocab_size=vocab_size, num_blocks=num_blocks, first_block=first_block)
    if groups is None:
        return CheckResult(name, True, tolerance=tolerance, detail=f"not run: the KV pool has {num_blocks} blocks")
    for group in groups:
        for _ in range(STEPS_PER_GROUP):
            engine.step(group)
    worst, where = 0.0, ""
    for step, (phase, hidden, reference) in enumerate(engine.records):
        error = relative_error(hidden, reference)
        if error > worst or not where:
            worst, where = error, f"step {step} ({phase})"
    phases = sorted({phase for phase, _, _ in engine.records})
    detail = (f"max relative error {worst:.2e} at {where}, tolerance {tolerance:.0e} ({dtype}); "
              f"probes: {', '.join(probes)}; steps: {', '.join(phases)}")
    return CheckResult(name, worst <= tolerance, worst, tolerance, detail)


def _add_probes(engine: StepEngine, probes: dict, *, vocab_size: int, num_blocks: int,
                first_block: int) -> list[list[str]] | None:
    """The probe requests on blocks from `first_block` on, grouped to step together
    (None: the pool is too small).  A CFG twin's K/V start inside a block:
    flash-attention sends such steps to Triton, so the probes without a twin step on
    their own and reach flash."""
    ids = engine.ids
    special = {ids.mask, ids.eos, ids.eot}
    tokens = [t for t in range(3, min(vocab_size, 4096)) if t not in special]
    block = first_block
    groups: dict[bool, list[str]] = {False: [], True: []}
    for index, (probe, options) in enumerate(probes.items()):
        copies = sequence_copies(options)
        need = -(-copies * (PROBE_PROMPT + options.gen_length) // engine.block_size)
        if block + need > num_blocks:
            return None
        prompt = [tokens[(97 * index + 31 * j) % len(tokens)] for j in range(PROBE_PROMPT)]
        engine.add(probe, prompt, options, seed=index, block_ids=list(range(block, block + need)))
        block += need
        groups[copies == 2].append(probe)
    return [group for group in groups.values() if group]


def check_step_graphs(engine_kwargs: dict, probes: dict, *, num_blocks: int, vocab_size: int,
                      first_block: int = 1) -> CheckResult:
    """Whole-step graphs (engine/step_graphs.py) against the same engine without
    them: every probe runs its canvas to the end in calls of up to a block's steps,
    as the scheduler prices them, once each way on the same blocks.  Every call's
    steps and new tokens must be identical: both run the same kernels on the same
    inputs, one launched from a graph."""
    name = "whole-step CUDA graphs"
    runs, captured = [], 0
    for graphed in (True, False):
        engine = StepEngine(**{**engine_kwargs, "capacity": len(probes), "step_graphs": graphed})
        if graphed and engine.step_graphs is None:
            return CheckResult(name, True, detail="not run: this engine captures no whole steps")
        groups = _add_probes(engine, probes, vocab_size=vocab_size, num_blocks=num_blocks, first_block=first_block)
        if groups is None:
            return CheckResult(name, True, detail=f"not run: the KV pool has {num_blocks} blocks")
        calls = []
        for group in groups:
            tracks = {p: RequestTrack(probes[p].placed(PROBE_PROMPT), PROBE_PROMPT, blocks=0) for p in group}
            # A call steps at least once: the bound only stops a graph that would undo them.
            while (live := [p for p in group if tracks[p].block < tracks[p].num_blocks]) and len(calls) < MAX_CALLS:
                steps = min(tracks[p].steps_in_call(PROBE_BLOCK) for p in live)
                phases = [tracks[p].phase() for p in live]
                out = engine.step(live, [tracks[p].call_tokens(steps) for p in live], steps=steps)
                calls.append((out.steps, out.new_tokens))
                for p, phase, progress in zip(live, phases, out.progress):
                    tracks[p].advance(phase, progress)
        runs.append(calls)
        if graphed:  # a capture that failed leaves none, and no further one is tried
            captured = len(engine.step_graphs.graphs)
    graphed, plain = runs
    differing = sum(a != b for a, b in zip(graphed, plain)) + abs(len(graphed) - len(plain))
    detail = (f"{differing} of {len(plain)} calls differ in steps or tokens (identical required); "
              f"{captured} graphs captured (at least one required); probes: {', '.join(probes)}")
    return CheckResult(name, differing == 0 and captured > 0, float(differing), 0.0, detail,
                       reference="the same engine without them")


# Philox inputs at their edges: seeds of both 32-bit halves and the int64 sign bit,
# positions -1 (the whole canvas), steps and streams past 32 bits.
_SEEDS = [0, 1, 0xFFFFFFFF, 1 << 32, (1 << 63) - 1, -1, -(1 << 63), 0x123456789ABCDEF]
_STEPS = [0, 1, 7, 0xFFFFFFFF, 1 << 32, 3, 1000, 5]
_POSITIONS = [0, -1, 5, 1 << 31, 0xFFFFFFFF, 2, 63, 511]


def check_philox(device: torch.device, candidate: Callable | None = None,
                 reference: Callable = philox.uniform_rows) -> CheckResult:
    """`candidate` (the Triton kernel by default) against the torch Philox: identical
    bits required (the contract is bit-exact: tolerance 0)."""
    if candidate is None:
        from vllm_dllm.decoding.triton_philox import uniform_rows_triton as candidate
    name = "Triton Philox kernel"
    seeds, steps, positions = (torch.tensor(v, dtype=torch.int64, device=device) for v in (_SEEDS, _STEPS, _POSITIONS))
    compared = differing = 0
    for dtype in (torch.float32, torch.float64):
        for stream in (1, 5, 0xFFFFFFFF):
            for n in (1, 3000):  # one draw per row; several kernel blocks per row
                got = candidate(seeds, steps, positions, stream, n, dtype)
                want = reference(seeds, steps, positions, stream, n, dtype)
                compared += want.numel()
                differing += want.numel() if got.shape != want.shape else int((got != want).sum())
    detail = f"{differing} of {compared} draws differ (bit-exact required)"
    return CheckResult(name, differing == 0, differing / compared, 0.0, detail)


class SelfCheckFailed(RuntimeError):
    """A forced attention backend disagrees with the torch reference."""


def attention_verdict(result: CheckResult, forced: str | None) -> bool:
    """True: keep the backend and graphs.  False: serve with the torch backend
    without graphs (logged).  Raises SelfCheckFailed when the user forced it."""
    if result.ok:
        logger.info("Self-check: %s", result)
        return True
    if forced is not None:
        raise SelfCheckFailed(
            f"Self-check: {result}. The attention backend {forced!r} was forced by "
            f"--additional-config '{{\"dllm\": {{\"attention_backend\": \"{forced}\"}}}}': refusing to start; "
            "leave attention_backend unset to fall back to the torch backend, or set it to 'torch'"
        )
    logger.error("Self-check: %s; serving with the torch attention backend without CUDA graphs", result)
    return False


def philox_verdict(result: CheckResult) -> bool:
    """True: keep the Triton Philox.  False: sampling draws with the torch Philox (logged)."""
    if result.ok:
        logger.info("Self-check: %s", result)
        return True
    logger.error("Self-check: %s; sampling draws with the torch Philox instead", result)
    return False


def run(engine_kwargs: dict, defaults, *, num_blocks: int, vocab_size: int, dtype: torch.dtype,
        philox_candidate: Callable | None = None) -> bool:
    """The start-up check (the runner calls it on CUDA, the KV pool bound).  Returns
    whether the engine keeps its backend and graphs; a failing Philox kernel is
    switched off for sampling here.  `philox_candidate`: the kernel to check (the
    Triton one, where Triton is installed, by default)."""
    from vllm_dllm.decoding import triton_philox

    keep = True
    if engine_kwargs["backend"].name != "torch":  # torch is the reference itself
        result = check_attention(engine_kwargs, probe_options(defaults), num_blocks=num_blocks,
                                 vocab_size=vocab_size, dtype=dtype)
        forced = defaults.attention_backend if defaults.attention_backend != "torch" else None
        keep = attention_verdict(result, forced)
    if philox_candidate is None and triton_philox.HAS_TRITON:
        philox_candidate = triton_philox.uniform_rows_triton
    if philox_candidate is not None:
        if not philox_verdict(check_philox(engine_kwargs["device"], philox_candidate)):
            triton_philox.disable("the start-up self-check found it disagreeing with the torch Philox")
    return keep


def run_step_graphs(engine_kwargs: dict, defaults, *, num_blocks: int, vocab_size: int) -> bool:
    """The whole-step graphs' check (after `run` kept the backend and its graphs):
    whether the engine keeps them; if not, it serves with Reuse graphs alone (logged)."""
    result = check_step_graphs(engine_kwargs, probe_options(defaults), num_blocks=num_blocks, vocab_size=vocab_size)
    if result.ok:
        logger.info("Self-check: %s", result)
        return True
    logger.error("Self-check: %s; serving without whole-step graphs (the Reuse graphs stay)", result)
    return False


def main(argv: list[str] | None = None) -> int:
    """The check without vLLM, on a random-weight plain-torch model of LLaDA's layout
    (benchmarks/gpu_session.sh check runs it on a lent GPU):
    `python -m vllm_dllm.worker.self_check [--device cuda] [--dtype bfloat16]`."""
    import argparse

    from vllm_dllm.attention.backends import select_backend
    from vllm_dllm.decoding.base import SpecialIds
    from vllm_dllm.engine.torch_model import ModelShape, build_model
    from vllm_dllm.options import LLADA
    from vllm_dllm.serving.server_defaults import ServerDefaults

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    shape = ModelShape(vocab_size=4096, hidden_size=1024, intermediate_size=2048, num_layers=8, num_heads=8,
                       num_kv_heads=8)
    model = build_model(shape, dtype, device, seed=0)
    num_blocks, block_size = 64, 16
    model.allocate_kv_pool(num_blocks=num_blocks, block_size=block_size, dtype=dtype, device=device)
    kwargs = dict(model=model, kind=LLADA, ids=SpecialIds(mask=shape.vocab_size - 1, eos=1, eot=2), capacity=4,
                  max_model_len=128, block_size=block_size, max_num_logits=1024, backend=select_backend(device),
                  device=device, cuda_graphs=device.type == "cuda")
    results = [check_philox(device)] if device.type == "cuda" else []
    if kwargs["backend"].name != "torch":
        probes = probe_options(ServerDefaults.build(LLADA, {}, {}))
        results.append(check_attention(kwargs, probes, num_blocks=num_blocks, vocab_size=shape.vocab_size,
                                       dtype=dtype))
        results.append(check_step_graphs(kwargs, probes, num_blocks=num_blocks, vocab_size=shape.vocab_size))
    for result in results:
        print(result)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
