"""The start-up self-check (worker/self_check.py) on a CPU: stand-in backends that agree
with the torch reference and one whose attend perturbs its output, with the CUDA-graph
path replaced by a capture that re-runs the captured forward on the graph's buffers;
stand-in Philox kernels that agree and disagree; the runner's fallback and refusal."""

from __future__ import annotations

import contextlib
import functools
import logging
from types import SimpleNamespace

import pytest
import torch

from vllm_dllm.attention.backends import TorchAttention
from vllm_dllm.decoding import philox, triton_philox
from vllm_dllm.engine.engine import StepEngine
from vllm_dllm.engine.torch_model import build_model
from vllm_dllm.options import LLADA
from vllm_dllm.serving.server_defaults import ServerDefaults
from vllm_dllm.worker import runner as runner_module
from vllm_dllm.worker import self_check
from vllm_dllm.worker.self_check import SelfCheckFailed, check_attention, check_philox, probe_options
from tests.unit.test_reuse_graphs import PagedReference, RerunCapture
from tests.unit.test_step_engine import BLOCK_SIZE, IDS, SHAPE

NUM_BLOCKS = 64


class StandIn(PagedReference):
    """Graph-safe paged attention (reads only the metadata's tensors); `perturb`
    scales its output, as a wrong kernel would change it."""

    name = "stand-in"

    def __init__(self, perturb: float = 0.0):
        self.perturb = perturb

    def attend(self, q, k, v, cache, meta, scale):
        return super().attend(q, k, v, cache, meta, scale) * (1 + self.perturb)


def engine_kwargs(backend, graphs=True) -> dict:
    model = build_model(SHAPE, torch.float32, "cpu", seed=0)
    model.allocate_kv_pool(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, dtype=torch.float32, device="cpu")
    return dict(model=model, kind="llada", ids=IDS, capacity=8, max_model_len=128, block_size=BLOCK_SIZE,
                max_num_logits=1024, backend=backend, device=torch.device("cpu"), cuda_graphs=graphs,
                graph_capture=RerunCapture() if graphs else None)


def defaults(**server) -> ServerDefaults:
    return ServerDefaults.build(LLADA, {}, server)


def run_check(backend, graphs=True):
    return check_attention(engine_kwargs(backend, graphs), probe_options(defaults()), num_blocks=NUM_BLOCKS,
                           vocab_size=SHAPE.vocab_size, dtype=torch.float32)


def test_probes_cover_a_cfg_twin_and_a_sparse_cache():
    probes = probe_options(defaults())
    assert list(probes) == ["dual cache", "CFG twin", "sparse cache"]
    assert probes["CFG twin"].cfg_scale == 1.0 and probes["sparse cache"].cache == "sparse"


def test_an_agreeing_backend_passes_through_refresh_and_graphed_reuse_steps():
    result = run_check(StandIn())
    assert result.ok and result.error < 1e-5, result
    # Refresh, a captured and a replayed Reuse graph, for the twin-free group and the CFG one.
    for phase in ("Refresh", "Reuse, graph captured", "Reuse, graph replayed"):
        assert phase in result.detail, result.detail
    assert "attention backend 'stand-in' with CUDA graphs" in str(result)


def test_a_perturbing_backend_is_caught_and_named():
    result = run_check(StandIn(perturb=0.05), graphs=False)
    assert not result.ok and result.error > result.tolerance == self_check.TOLERANCES[torch.float32]
    assert str(result).startswith("attention backend 'stand-in' DISAGREES with its torch reference")


@pytest.mark.usefixtures("plugin_logs")
def test_run_falls_back_with_an_error_naming_the_backend(caplog):
    with caplog.at_level(logging.INFO, logger=self_check.logger.name):
        keep = self_check.run(engine_kwargs(StandIn(perturb=0.05)), defaults(), num_blocks=NUM_BLOCKS,
                              vocab_size=SHAPE.vocab_size, dtype=torch.float32, philox_candidate=philox.uniform_rows)
    assert keep is False
    [error] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "attention backend 'stand-in' with CUDA graphs DISAGREES" in error.getMessage()
    assert "serving with the torch attention backend without CUDA graphs" in error.getMessage()


@pytest.mark.usefixtures("plugin_logs")
def test_run_keeps_an_agreeing_backend(caplog):
    with caplog.at_level(logging.INFO, logger=self_check.logger.name):
        assert self_check.run(engine_kwargs(StandIn()), defaults(), num_blocks=NUM_BLOCKS,
                              vocab_size=SHAPE.vocab_size, dtype=torch.float32, philox_candidate=philox.uniform_rows)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert sum("agrees with its torch reference" in r.getMessage() for r in caplog.records) == 2  # attention, Philox


def test_a_forced_backend_refuses_to_start():
    with pytest.raises(SelfCheckFailed, match="attention backend 'stand-in'.*DISAGREES.*'triton' was forced.*refusing"):
        self_check.run(engine_kwargs(StandIn(perturb=0.05)), defaults(attention_backend="triton"),
                       num_blocks=NUM_BLOCKS, vocab_size=SHAPE.vocab_size, dtype=torch.float32)


def test_a_small_pool_skips_the_check():
    result = check_attention(engine_kwargs(StandIn(perturb=0.05)), probe_options(defaults()), num_blocks=8,
                             vocab_size=SHAPE.vocab_size, dtype=torch.float32)
    assert result.ok and "not run" in result.detail


def flipped_philox(seeds, steps, positions, stream, n, dtype):
    """The torch Philox with one draw's lowest bit flipped."""
    out = philox.uniform_rows(seeds, steps, positions, stream, n, dtype)
    out[0, 0] = torch.nextafter(out[0, 0], torch.tensor(1.0, dtype=dtype))
    return out


def test_philox_must_match_bit_for_bit():
    assert check_philox(torch.device("cpu"), philox.uniform_rows).ok
    result = check_philox(torch.device("cpu"), flipped_philox)
    assert not result.ok and result.name == "Triton Philox kernel" and "12 of " in result.detail  # 2 dtypes x 3 streams x 2 sizes


@pytest.mark.usefixtures("plugin_logs")
def test_a_disagreeing_philox_is_switched_off_for_sampling(monkeypatch, caplog):
    monkeypatch.setattr(triton_philox, "HAS_TRITON", True)
    monkeypatch.setattr(triton_philox, "disabled_reason", None)
    with caplog.at_level(logging.INFO, logger=self_check.logger.name):
        keep = self_check.run(engine_kwargs(TorchAttention(), graphs=False), defaults(), num_blocks=NUM_BLOCKS,
                              vocab_size=SHAPE.vocab_size, dtype=torch.float32, philox_candidate=flipped_philox)
    assert keep  # the torch backend is the reference: not checked against itself
    assert triton_philox.HAS_TRITON is False and "self-check" in triton_philox.disabled_reason
    [error] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "Triton Philox kernel DISAGREES" in error.getMessage() and "torch Philox instead" in error.getMessage()


class StaleCapture(RerunCapture):
    """A capture whose replays of a whole step do nothing: a graph that lost its
    kernels, as a broken capture would."""

    def __call__(self, fn, pool):
        replay, output = super().__call__(fn, pool)
        if output.dtype == torch.long:  # a whole step's [tally, goes on]
            return (lambda: None), output
        return replay, output


def cpu_runner(monkeypatch, backend, capture=RerunCapture):
    """A DiffusionModelRunner on the CPU whose engine uses `backend` and `capture`."""
    kwargs = engine_kwargs(backend)
    monkeypatch.setattr(triton_philox, "HAS_TRITON", False)  # its kernel needs CUDA (or the interpreter)
    monkeypatch.setattr(runner_module, "special_ids", lambda model_config, kind: IDS)
    monkeypatch.setattr(runner_module, "prefill_chunk", lambda vllm_config: 0)
    monkeypatch.setattr(runner_module, "select_backend", lambda device, requested: kwargs["backend"])
    runner = runner_module.DiffusionModelRunner.__new__(runner_module.DiffusionModelRunner)
    runner.model = kwargs["model"]
    runner.device = torch.device("cpu")
    runner.defaults = defaults()
    runner.block_size = BLOCK_SIZE
    runner.model_config = SimpleNamespace(max_model_len=128, enforce_eager=False, max_logprobs=20,
                                          get_vocab_size=lambda: SHAPE.vocab_size, dtype=torch.float32)
    runner.vllm_config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=4))
    runner.kv_caches = [torch.empty(NUM_BLOCKS, 1)]  # its first dimension: the pool's blocks
    runner._graph_capture = lambda: capture()
    runner._forward_context = lambda num_tokens: contextlib.nullcontext()  # vLLM's needs its config
    return runner


def test_the_runner_rebuilds_its_engine_on_the_torch_backend_without_graphs(monkeypatch):
    """DiffusionModelRunner._self_check (run on CUDA only) with the stand-in backend."""
    runner = cpu_runner(monkeypatch, StandIn(perturb=0.05))
    runner._build_engine()
    assert runner.engine.backend.name == "stand-in" and runner.engine.graphs is not None
    runner.self_check()  # on a CPU: nothing runs
    assert runner.engine.backend.name == "stand-in"
    runner._self_check()
    assert runner._torch_fallback
    assert runner.engine.backend.name == "torch" and runner.engine.graphs is None
    runner._build_engine()  # a later rebuild (update_max_model_len) keeps the fallback
    assert runner.engine.backend.name == "torch" and runner.engine.graphs is None


@pytest.mark.parametrize("capture,kept", [(RerunCapture, True), (StaleCapture, False)])
def test_the_runner_keeps_whole_step_graphs_only_where_they_agree(monkeypatch, capture, kept):
    """As on CUDA, where the engine's LM head runs over whole windows by default."""
    for module in (runner_module, self_check):
        monkeypatch.setattr(module, "StepEngine", functools.partial(StepEngine, window_candidates=True))
    runner = cpu_runner(monkeypatch, StandIn(), capture)
    runner._build_engine()
    assert runner.engine.step_graphs is not None
    runner._self_check()
    assert not runner._torch_fallback and runner.engine.graphs is not None  # the backend and Reuse graphs stay
    assert (runner.engine.step_graphs is not None) is kept
    runner._build_engine()
    assert (runner.engine.step_graphs is not None) is kept


def test_the_vllm_free_entry_point_runs_where_there_is_nothing_to_check():
    # On a CPU the torch paths are the references; on a GPU benchmarks/gpu_session.sh
    # runs it with the Triton/flash backend, CUDA graphs and the Triton Philox.
    assert self_check.main(["--device", "cpu", "--dtype", "float32"]) == 0


class UncapturableCapture(RerunCapture):
    """A capture that fails for a whole step (an op it cannot hold), as on a GPU."""

    def __call__(self, fn, pool):
        replay, output = super().__call__(fn, pool)
        if output.dtype == torch.long:  # a whole step's [tally, goes on]
            raise RuntimeError("operation not permitted when stream is capturing (stand-in)")
        return replay, output


@pytest.mark.parametrize("capture,ok", [(RerunCapture, True), (StaleCapture, False), (UncapturableCapture, False)])
def test_whole_step_graphs_are_checked_against_the_same_engine_without_them(capture, ok):
    kwargs = {**engine_kwargs(StandIn()), "graph_capture": capture(), "window_candidates": True}
    result = self_check.check_step_graphs(kwargs, probe_options(defaults()), num_blocks=NUM_BLOCKS,
                                          vocab_size=SHAPE.vocab_size)
    assert result.ok is ok, result
    # A stale graph changes calls; a capture that fails leaves nothing checked.
    assert result.detail.startswith("0 of") is (capture is not StaleCapture)
    assert ("0 graphs captured" in result.detail) is (capture is UncapturableCapture)
