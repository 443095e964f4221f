"""How long the CPU worker's idle OpenMP threads spin, on small machines.

torch's CPU build runs its parallel regions on GNU OpenMP (libgomp).  A libgomp
thread that finishes a region spins GOMP_SPINCOUNT times before it sleeps: 300,000
unless OMP_WAIT_POLICY says otherwise.  vLLM sets the thread binding for libgomp and
leaves the spin alone (for Intel's OpenMP it sets a 5 ms block time).

On a machine with at most SMALL_MACHINE_CPUS usable CPUs the worker's threads hold
every core (compat.reserve_no_cpu_on_small_machine), and between two denoising steps
its idle thread spins on the core the engine-core process needs to plan and hand over
the next step.  The spin should outlast the gaps between a forward's parallel regions
(tens of microseconds of Python) and end well inside the gap between steps (about a
millisecond).  Measured on a 2-core AMD EPYC, against libgomp's 300,000 in the same
invocation (benchmarks/engine_overhead.py, benchmarks/results/engine-overhead/spin/):
with 10,000 spins one request at a time ran 1.22-1.41x (the time between steps fell
from 2.1-2.9 to 0.8-1.0 ms), 32 concurrent 1.05-1.08x, and beside a busy neighbour
1.05-1.2x.  The variable is read when libgomp loads, so it is set in the serving
process's environment before vLLM spawns the engine core and its worker, which
inherit it.  A user's GOMP_SPINCOUNT or OMP_WAIT_POLICY wins.
"""

from __future__ import annotations

import os

from vllm_dllm.serving.compat import SMALL_MACHINE_CPUS

SPIN_ENV = "GOMP_SPINCOUNT"
WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
SMALL_MACHINE_SPIN = 10_000


def shorten_spin_on_small_machine(environ=os.environ, usable_cpus: int | None = None) -> bool:
    """Set GOMP_SPINCOUNT to SMALL_MACHINE_SPIN on a small machine unless the user
    chose a spin or a wait policy.  Returns whether it did."""
    if SPIN_ENV in environ or WAIT_POLICY_ENV in environ:
        return False
    if usable_cpus is None:
        usable_cpus = len(os.sched_getaffinity(0))
    if usable_cpus > SMALL_MACHINE_CPUS:
        return False
    environ[SPIN_ENV] = str(SMALL_MACHINE_SPIN)
    return True
