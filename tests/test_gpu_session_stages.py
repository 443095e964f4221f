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


def _unpack(out: Path, stage: str, into: Path) -> Path:
    """The stage's archive, whole or in the parts a large one comes back in."""
    parts = sorted(out.glob(f"{stage}.tgz.part-*")) or [out / f"{stage}.tgz"]
    into.mkdir(parents=True, exist_ok=True)
    whole = into / f"{stage}.tgz"
    whole.write_bytes(b"".join(p.read_bytes() for p in parts))
    with tarfile.open(whole) as archive:
        archive.extractall(into, filter="data")
    return into / stage


def test_train_continues_the_converted_run_and_brings_back_what_continues_it(tmp_path):
    quick = dict(TRAIN_DEVICE="cpu", TRAIN_MINUTES="0.01", TRAIN_THREADS="2")
    first = _run("train", tmp_path / "out1", RUNS_DIR=str(tmp_path / "runs"), **quick)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    got = _unpack(tmp_path / "out1", "train", tmp_path / "got1")
    # The lineage git carries: the shipped LLaDA2 model.
    assert "initialised from vllm_dllm/llada2_model" in (got / "train.log").read_text()
    assert (got / "model" / "config.json").exists() and (got / "model" / "model.safetensors").exists()
    assert '"step": 1,' in (got / "train_log.jsonl").read_text()
    # On the same warm machine the next call resumes the run.
    again = _run("train", tmp_path / "out2", RUNS_DIR=str(tmp_path / "runs"), **quick)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert "resumed at step" in (_unpack(tmp_path / "out2", "train", tmp_path / "got2") / "train.log").read_text()
    # On a fresh machine it starts from the weights a call brought back.
    carried = _run("train", tmp_path / "out3", RUNS_DIR=str(tmp_path / "fresh"), TRAIN_FROM=str(got / "weights.pt"),
                   **quick)
    assert carried.returncode == 0, carried.stdout[-2000:] + carried.stderr[-2000:]
    log = (_unpack(tmp_path / "out3", "train", tmp_path / "got3") / "train.log").read_text()
    assert f"initialised from {got / 'weights.pt'}" in log
