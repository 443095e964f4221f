"""Behaviour that differs between the supported vLLM releases (0.32, 0.33, 0.34),
handled in compat.py and scheduler/accounting.py: our side of each difference, under
each release's rules."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
from vllm.config import CacheConfig

from vllm_dllm.serving import compat
from vllm_dllm.scheduler.accounting import ComputedTokensAccounting, computed_before_update

# ---- num_computed_tokens at a stop ------------------------------------------------------

EOS = 0
V033, V034 = "0.33.0", "0.34.0+cpu"


@dataclass
class FakeRequest:
    prompt: list[int]
    max_tokens: int
    output: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    finished: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def is_finished(self) -> bool:
        return self.finished


class VllmScheduler:
    """The part of vLLM's Scheduler.update_from_output our accounting meets: append
    each new token, stop at EOS or max_tokens, trim what follows the stop and, as
    vLLM 0.33 does (`trims`), subtract the trimmed tokens from num_computed_tokens."""

    trims = False

    def __init__(self, requests):
        self.requests = requests

    def update_from_output(self, scheduler_output, model_runner_output):
        kept = {}
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests[req_id]
            new = list(model_runner_output.sampled_token_ids[model_runner_output.req_ids.index(req_id)])
            for count, token in enumerate(new, 1):
                request.output.append(token)
                if token == EOS or len(request.output) >= request.max_tokens:
                    request.finished = True
                    if self.trims:
                        request.num_computed_tokens -= len(new) - count
                    del new[count:]
                    break
            kept[req_id] = new
        for req_id in [r for r, req in self.requests.items() if req.finished]:
            del self.requests[req_id]  # finished requests leave the scheduler
        return kept


class Vllm033(VllmScheduler):
    trims = True


def step(scheduler, tokens: dict[str, list[int]]):
    order = list(tokens)
    return scheduler.update_from_output(
        SimpleNamespace(num_scheduled_tokens={r: 8 for r in order}),
        SimpleNamespace(req_ids=order,
                        sampled_token_ids=[tokens[r] for r in order]),
    )


def make_scheduler(base, ours_trims: bool, requests):
    class Scheduler(ComputedTokensAccounting, base):
        base_trims_on_stop = ours_trims

    return Scheduler(requests)


@pytest.mark.parametrize("base", [VllmScheduler, Vllm033], ids=["vllm-0.32", "vllm-0.33"])
def test_computed_tokens_stay_one_behind_the_sequence(base):
    a, b = FakeRequest([5, 6, 7], max_tokens=16), FakeRequest([5, 6], max_tokens=16)
    scheduler = make_scheduler(base, base.trims, {"a": a, "b": b})
    step(scheduler, {"a": [], "b": [9]})  # a commits nothing yet
    assert a.num_computed_tokens == a.num_tokens == 3
    assert b.num_computed_tokens == b.num_tokens - 1 == 2
    # a: a stop in the middle of a multi-token commit trims 3 tokens.
    kept = step(scheduler, {"a": [9, 9, EOS, 4, 4, 4], "b": [9, 9]})
    assert kept["a"] == [9, 9, EOS]
    assert a.num_computed_tokens == a.num_tokens - 1 == 5
    assert b.num_computed_tokens == b.num_tokens - 1 == 4


@pytest.mark.parametrize("base", [VllmScheduler, Vllm033], ids=["vllm-0.32", "vllm-0.33"])
def test_a_stop_at_the_first_new_token_never_goes_negative(base):
    # Without our accounting the counter sits at 0 and 0.33 would make it -7.
    request = FakeRequest([1], max_tokens=16)
    scheduler = make_scheduler(base, base.trims, {"r": request})
    step(scheduler, {"r": [EOS] + [3] * 7})
    assert request.output == [EOS]
    assert request.num_computed_tokens == request.num_tokens - 1 == 1


def test_max_tokens_stop_is_trimmed_like_eos():
    request = FakeRequest([1, 2], max_tokens=3)
    scheduler = make_scheduler(Vllm033, True, {"r": request})
    step(scheduler, {"r": [7, 7, 7, 7, 7]})
    assert request.num_computed_tokens == request.num_tokens - 1 == 4


def test_the_version_flag_matters():
    """Our flag must match the base's behaviour: trimming twice (or never) is wrong."""
    for base, wrong_flag in ((Vllm033, False), (VllmScheduler, True)):
        request = FakeRequest([1], max_tokens=16)
        step(make_scheduler(base, wrong_flag, {"r": request}), {"r": [2, EOS, 3, 3]})
        assert request.num_computed_tokens != request.num_tokens - 1


def test_computed_before_update():
    assert computed_before_update(10, 0) == 10
    assert computed_before_update(10, 1) == 10
    assert computed_before_update(10, 4) == 13


@pytest.mark.parametrize("found, trims", [("0.32.0", False), ("0.32.1+cpu", False), ("0.33.0", True), ("0.33.2", True), ("0.34.0", True)])
def test_stop_trim_version_check(found, trims):
    assert compat.stop_trims_computed_tokens(found) is trims


def test_the_installed_vllm_sets_the_scheduler_flag():
    from vllm_dllm.scheduler.scheduler import DiffusionScheduler

    assert DiffusionScheduler.base_trims_on_stop is compat.stop_trims_computed_tokens()
    assert DiffusionScheduler.__mro__.index(ComputedTokensAccounting) < [
        c.__name__ for c in DiffusionScheduler.__mro__
    ].index("Scheduler")


# ---- block size default ---------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_block_size_default_is_ours_where_the_user_chose_none(device):
    cache = CacheConfig()  # vLLM's own default: 16 under both versions
    assert not cache.user_specified_block_size
    compat.set_default_block_size(cache, device)
    assert cache.block_size == compat.DEFAULT_BLOCK_SIZE[device]


def test_a_user_block_size_is_kept():
    cache = CacheConfig(block_size=32)
    compat.set_default_block_size(cache, "cpu")
    assert cache.block_size == 32


# ---- V2 model runner off -------------------------------------------------------------------------


def test_v2_runner_is_switched_off_when_unset():
    environ = {}
    compat.keep_v1_model_runner(environ, found=V033)
    assert environ == {compat.V2_RUNNER_ENV: "0"}
    compat.keep_v1_model_runner(environ, found=V033)  # idempotent


def test_a_user_asking_for_v2_gets_a_clear_error():
    with pytest.raises(RuntimeError, match="VLLM_USE_V2_MODEL_RUNNER=1"):
        compat.keep_v1_model_runner({compat.V2_RUNNER_ENV: "1"}, found=V033)


# ---- CPU worker threads on small machines -----------------------------------------------------


def test_a_small_machine_gives_the_worker_every_core():
    environ = {}
    assert compat.reserve_no_cpu_on_small_machine(environ, usable_cpus=compat.SMALL_MACHINE_CPUS)
    assert environ == {compat.RESERVED_CPU_ENV: "0"}
    assert compat.reserve_no_cpu_on_small_machine({}, usable_cpus=1)


def test_a_larger_machine_keeps_vllms_reserved_core():
    environ = {}
    assert not compat.reserve_no_cpu_on_small_machine(environ, usable_cpus=compat.SMALL_MACHINE_CPUS + 1)
    assert environ == {}


def test_the_users_reserved_cpu_setting_wins():
    environ = {compat.RESERVED_CPU_ENV: "1"}
    assert not compat.reserve_no_cpu_on_small_machine(environ, usable_cpus=1)
    assert environ == {compat.RESERVED_CPU_ENV: "1"}


def test_vllms_thread_binding_reads_the_reserved_cpu_setting(monkeypatch):
    """The variable does what the default relies on: with 0 reserved, vLLM's automatic
    binding gives the one local worker every allowed CPU of its NUMA node."""
    from types import SimpleNamespace

    from vllm.utils import cpu_resource_utils
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    monkeypatch.setenv(compat.RESERVED_CPU_ENV, "0")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    config = SimpleNamespace(
        parallel_config=SimpleNamespace(local_world_size=1, data_parallel_rank_local=0, _api_process_count=1,
                                        assigned_physical_gpu_ids=None),  # read from vLLM 0.34 on
        kv_transfer_config=None,
    )
    manager = OMPProcessManager(config)
    node = cpu_resource_utils.get_visible_memory_node()[0]
    node_cpus = [cpu for cpu in cpu_resource_utils.get_allowed_cpu_list() if cpu.numa_node == node]
    assert manager.reserve_cpu_num == 0
    assert manager.reserved_cpu_list == []
    # x86 binds one logical CPU per physical core: one per core of the node, none kept back.
    assert len(manager.cpu_lists) == 1
    assert len(manager.cpu_lists[0]) == len({cpu.physical_core for cpu in node_cpus})
    assert set(manager.cpu_lists[0]) <= {cpu.id for cpu in node_cpus}


# ---- vLLM's compilation stays off for our models ----------------------------------------------


def test_unset_compilation_modes_are_turned_off():
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    config = CompilationConfig()
    compat.keep_vllm_compilation_off(config)
    assert config.mode == CompilationMode.NONE and config.cudagraph_mode == CUDAGraphMode.NONE
    chosen = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.PIECEWISE)
    compat.keep_vllm_compilation_off(chosen)
    assert chosen.mode == CompilationMode.VLLM_COMPILE and chosen.cudagraph_mode == CUDAGraphMode.PIECEWISE


def test_on_cuda_the_hook_turns_unset_modes_off_before_vllm_resolves_them(tiny_dirs, monkeypatch):
    """The hook runs while vLLM builds the config, before it fills unset modes in
    (VLLM_COMPILE on CUDA, which resolves custom_ops to 'none'): with the modes off,
    vLLM keeps its fused kernels ('all').  The device is made to read as CUDA."""
    from vllm.config.compilation import CompilationMode, CUDAGraphMode
    from vllm.engine.arg_utils import EngineArgs

    import vllm_dllm
    from vllm_dllm.serving import server_config

    vllm_dllm.register()
    monkeypatch.setattr(server_config, "_device", lambda: "cuda")
    config = EngineArgs(model=tiny_dirs("llada"), max_model_len=256).create_engine_config()
    assert config.compilation_config.mode == CompilationMode.NONE
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    assert "all" in config.compilation_config.custom_ops


# ---- vLLM 0.34: no V1 runners, new records -------------------------------------------------------


@pytest.mark.parametrize("found, has", [("0.32.0+cpu", True), ("0.33.2", True), ("0.34.0", False), ("0.34.1+cpu", False)])
def test_v1_runner_version_check(found, has):
    assert compat.has_v1_runners(found) is has


def test_the_v1_switch_is_left_alone_where_vllm_has_none():
    environ = {}
    compat.keep_v1_model_runner(environ, found=V034)
    assert environ == {}
    compat.keep_v1_model_runner({compat.V2_RUNNER_ENV: "1"}, found=V034)  # no switch, nothing to refuse


def test_runner_output_fields_by_version():
    order = ["b", "a"]
    assert compat.runner_output_order(order, found=V033) == {"req_ids": order, "req_id_to_index": {"b": 0, "a": 1}}
    assert compat.runner_output_order(order, found=V034) == {"req_ids": order}
    assert compat.output_rows(SimpleNamespace(req_ids=order)) == {"b": 0, "a": 1}


def test_the_installed_vllm_builds_our_runner_output():
    """DiffusionRunnerOutput is vLLM's ModelRunnerOutput with the installed version's
    fields: vLLM's own scheduler finds each request's row in it."""
    from vllm_dllm.worker.runner import DiffusionRunnerOutput

    output = DiffusionRunnerOutput(**compat.runner_output_order(["x", "y"]), sampled_token_ids=[[1], [2, 3]])
    rows = compat.output_rows(output)
    assert output.sampled_token_ids[rows["y"]] == [2, 3]
    if compat.has_v1_runners():
        assert output.req_id_to_index == rows


def test_the_installed_vllm_takes_our_scheduler_records():
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData

    cached = compat.cached_request_data(["a", "b"], num_computed_tokens=[3, 4], num_output_tokens=[0, 1])
    assert isinstance(cached, CachedRequestData)
    assert cached.req_ids == ["a", "b"] and cached.new_block_ids == [None, None]
    assert cached.num_computed_tokens == [3, 4] and cached.num_output_tokens == [0, 1]

    request = SimpleNamespace(
        request_id="r", prompt_token_ids=[5, 6, 7], mm_features=[], sampling_params=None, pooling_params=None,
        num_computed_tokens=0, lora_request=None, prompt_embeds=None, prompt_is_token_ids=None,
        prefill_token_ids=[5, 6, 7], replay_start=0,
    )
    new = compat.new_request_data(request, ([1, 2],))
    assert isinstance(new, NewRequestData)
    assert new.req_id == "r" and new.prompt_token_ids == [5, 6, 7] and new.block_ids == ([1, 2],)
    if not compat.has_v1_runners():
        assert new.prefill_token_ids == [5, 6, 7]


def test_the_validator_subclasses_the_interface_vllm_loads():
    """vLLM loads --logits-processors entries as subclasses of its interface (V1's
    before 0.34, the V2 runner's from 0.34 on) and refuses others at start-up."""
    from vllm_dllm.serving.validation import DiffusionParamsValidator

    assert issubclass(DiffusionParamsValidator, compat.logits_processor_base())
    assert not getattr(DiffusionParamsValidator, "__abstractmethods__", None)


def vllm_config_with(jit_warmup=True, extensible=None):
    return SimpleNamespace(kernel_config=SimpleNamespace(enable_jit_warmup=jit_warmup),
                           cache_config=SimpleNamespace(enable_extensible_kv_cache=extensible))


def test_vllms_runner_warmups_are_turned_off_from_034():
    config = vllm_config_with()
    compat.keep_vllm_runner_warmups_off(config, found=V034)
    assert config.kernel_config.enable_jit_warmup is False
    assert config.cache_config.enable_extensible_kv_cache is False


def test_before_034_the_warmup_settings_are_not_touched():
    config = vllm_config_with()
    compat.keep_vllm_runner_warmups_off(config, found=V033)
    assert config.kernel_config.enable_jit_warmup is True
    assert config.cache_config.enable_extensible_kv_cache is None


def test_asking_for_the_extensible_kv_cache_is_refused_clearly():
    with pytest.raises(ValueError, match="--enable-extensible-kv-cache"):
        compat.keep_vllm_runner_warmups_off(vllm_config_with(extensible=True), found=V034)
