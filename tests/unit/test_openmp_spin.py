"""The OpenMP spin default for small CPU machines (vllm_dllm/openmp_spin.py)."""

from __future__ import annotations

from vllm_dllm.serving.compat import SMALL_MACHINE_CPUS
from vllm_dllm.serving.openmp_spin import SMALL_MACHINE_SPIN, SPIN_ENV, WAIT_POLICY_ENV, shorten_spin_on_small_machine


def test_a_small_machine_gets_a_short_spin():
    environ = {}
    assert shorten_spin_on_small_machine(environ, usable_cpus=SMALL_MACHINE_CPUS)
    assert environ == {SPIN_ENV: str(SMALL_MACHINE_SPIN)}
    assert shorten_spin_on_small_machine({}, usable_cpus=1)


def test_a_larger_machine_keeps_libgomps_spin():
    environ = {}
    assert not shorten_spin_on_small_machine(environ, usable_cpus=SMALL_MACHINE_CPUS + 1)
    assert environ == {}


def test_the_users_spin_or_wait_policy_wins():
    for chosen in ({SPIN_ENV: "300000"}, {WAIT_POLICY_ENV: "PASSIVE"}, {WAIT_POLICY_ENV: "ACTIVE"}):
        environ = dict(chosen)
        assert not shorten_spin_on_small_machine(environ, usable_cpus=1)
        assert environ == chosen


def test_libgomp_reads_the_spin_when_it_loads():
    """The default only works if the worker's OpenMP runtime is libgomp and reads the
    variable from the environment it starts with: a child process started with it
    reports it through libgomp's own environment display."""
    import subprocess
    import sys

    probe = "import torch; torch.set_num_threads(2); torch.ones(1 << 16).sum()"
    env = {SPIN_ENV: str(SMALL_MACHINE_SPIN), "OMP_DISPLAY_ENV": "VERBOSE", "PATH": ""}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"GOMP_SPINCOUNT = '{SMALL_MACHINE_SPIN}'" in out.stderr
