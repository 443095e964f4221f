"""benchmarks/gpu_session.sh's training stages, run here on the CPU: what a lent GPU
call brings back must be there (the device tool returns only files under $OUT)."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_session.sh"


def _run(stage: str, out: Path, **env) -> subprocess.CompletedProcess:
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["bash", str(SCRIPT), stage], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OUT": str(out), "PYTHON": sys.executable, **env})


def test_an_unknown_stage_is_refused_by_name(tmp_path):
    result = _run("trian", tmp_path)
    assert result.returncode == 2
    assert "unknown stage trian" in result.stderr and "lookup-probes" in result.stderr


def test_lookup_probes_bring_back_every_runs_log(tmp_path):
    result = _run("lookup-probes", tmp_path / "out", TRAIN_DEVICE="cpu", TRAIN_MINUTES="0.01",
                  RUNS_DIR=str(tmp_path / "runs"))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    with tarfile.open(tmp_path / "out" / "lookup-probes.tgz") as archive:
        names = {Path(n).name for n in archive.getnames()}
    runs = ("base", "mimetic", "lr5e-3", "noedit", "emb1", "dense")
    assert {f"{run}.jsonl" for run in runs} <= names and "device.txt" in names
    with tarfile.open(tmp_path / "out" / "lookup-probes.tgz") as archive:
        for run in runs:
            log = archive.extractfile(f"lookup-probes/{run}.jsonl").read().decode()
            assert '"step": 1,' in log and '"task": "recall"' in log, run  # each run trained
