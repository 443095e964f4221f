"""Running a Triton test module as a script in a fresh process.

Triton reads TRITON_INTERPRET when `@triton.jit` decorates a kernel, i.e. when the
kernel's module is first imported.  Inside pytest that module may already have been
imported without the flag, so a Triton test module runs itself as a script in a
subprocess (interpreted on the CPU, or compiled on CUDA), prints one JSON report as
its last `{...}` line, and its tests check the report case by case.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

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


def cuda_report_or_skip(script: str) -> dict:
    if not torch.cuda.is_available():
        pytest.skip(NO_CUDA_REASON)
    return run_script(script, "cuda", interpret=False)
