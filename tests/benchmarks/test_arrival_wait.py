"""benchmarks/arrival_wait.py end to end with two arrivals, in its own process (it
starts two in-process engines one after the other)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_arrival_wait_measures_both_settings(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "arrival_wait.py"), "--arrivals", "2", "--out", str(tmp_path)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "results.json").read_text())
    assert set(result["settings"]) == {"8", "1"}
    for setting in result["settings"].values():
        assert len(setting["rows"]) == 2
        # An arrival that fits starts at the next engine step, and streams later.
        assert setting["max_engine_steps"] == 1
        assert all(0 < r["wait_ms"] <= r["first_token_ms"] for r in setting["rows"])
    assert "| 8 |" in (tmp_path / "table.md").read_text()
