"""Running a Triton test module as a script in a fresh process.

Triton reads TRITON_INTERPRET when `@triton.jit` decorates a kernel, i.e. when the
kernel's module is first imported.  Inside pytest that module may already have been
imported without the flag, so a Triton test module runs itself as a script in a
subprocess (interpreted on the CPU, or compiled on CUDA), prints one JSON report as
its last `{...}` line, and its tests check the report case by case.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]

# Triton arrives with vLLM: on the CPU build through xgrammar, which requires it on Linux
# x86_64 (the machines `make test` runs on, Intel and AMD alike), and with torch on CUDA.
# This skip fires only where neither holds (an ARM or macOS CPU install): the kernels, used
# only on CUDA, then lose their interpreted coverage on that machine, and the reason says so.
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="triton not installed (vLLM's CPU build brings it only on Linux x86_64): the Triton kernels' "
           "interpreted and compiled cases cannot run here; the backend is used only on CUDA, where vLLM "
           "installs triton",
)

# The compiled (non-interpreted) runs need a GPU; on a CPU-only machine the same cases
# have run under TRITON_INTERPRET=1, so these skips lose no coverage the CPU can give.
NO_CUDA_REASON = "compiled Triton needs a CUDA device; the same cases ran under TRITON_INTERPRET=1"


def run_script(script: str, device: str, interpret: bool) -> dict:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run(
        [sys.executable, str(Path(script).resolve()), "--device", device],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise AssertionError(f"script crashed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return json.loads(lines[-1])


# A kernel whose loop bound is loaded at run time, the form the attention kernel takes.
# Triton 3.6's interpreter holds every scalar as a one-element array and turns a loop
# bound into an int with int(array), which NumPy >= 2.4 refuses ("only 0-dimensional
# arrays can be converted to Python scalars"); Triton 3.9's interpreter does not.
_RUNTIME_LOOP_PROBE = """
import torch, triton, triton.language as tl
@triton.jit
def count_tiles(bounds, out):
    n = tl.load(bounds + tl.program_id(0))
    tiles = 0
    for _ in range(0, n, 4):
        tiles += 1
    tl.store(out + tl.program_id(0), tiles)
bounds = torch.tensor([5, 8], dtype=torch.int32)
out = torch.zeros(2, dtype=torch.int32)
count_tiles[(2,)](bounds, out)
assert out.tolist() == [2, 2], out
"""


@functools.cache
def interpreter_runtime_loop_error() -> str | None:
    """Why this Triton's interpreter cannot run a loop with a run-time bound, or None."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", _RUNTIME_LOOP_PROBE], env=env, capture_output=True, text=True,
                          timeout=120)
    if proc.returncode == 0:
        return None
    import numpy
    import triton

    last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return f"triton {triton.__version__}'s interpreter under numpy {numpy.__version__}: {last}"


def interpreter_report_or_skip(script: str) -> dict:
    """The script's cases run under TRITON_INTERPRET=1 on the CPU.

    Where this Triton's interpreter cannot run a run-time loop bound, a machine with a
    GPU skips (the compiled cases run the same kernels there); a CPU-only machine fails,
    since the interpreter is its only coverage of the kernels."""
    error = interpreter_runtime_loop_error()
    if error is not None:
        if torch.cuda.is_available():
            pytest.skip(f"{error}; the compiled cases on this GPU cover the kernels")
        raise AssertionError(f"the Triton interpreter cannot run the kernels here ({error}): "
                             "install a triton whose interpreter passes this probe (3.9 does) or numpy < 2.4")
    return run_script(script, "cpu", interpret=True)


def cuda_report_or_skip(script: str) -> dict:
    if not torch.cuda.is_available():
        pytest.skip(NO_CUDA_REASON)
    return run_script(script, "cuda", interpret=False)
