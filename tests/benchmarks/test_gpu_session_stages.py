"""benchmarks/gpu_session.sh, the one prepared script a lent GPU machine runs: a
mistyped stage is refused by name before the machine's time is spent on it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_session.sh"


def test_an_unknown_stage_is_refused_by_name(tmp_path):
    result = subprocess.run(["bash", str(SCRIPT), "bnech"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                            env={**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable})
    assert result.returncode == 2
    assert "unknown stage bnech" in result.stderr and "check, bench or profile" in result.stderr
    assert not any(tmp_path.iterdir())  # nothing started
