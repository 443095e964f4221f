"""benchmarks/step_bench.py end to end at toy sizes, with vLLM made unimportable.

The step engine (batch state, step inputs, attention backends, decoding rules, RNG)
and its benchmark must run where torch and triton are installed but vLLM is not: the
GPU machine sometimes lent to a session (../shared/GPU.md).  A vLLM import creeping
into any of them would only show there, on scarce device time; so would a broken
case of the benchmark.  `--smoke` runs every case the full run has, at toy sizes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_without_vllm(name: str, *args: str) -> None:
    """Run benchmarks/<name> as a script in a process where every `import vllm...`
    raises ImportError (`sys.modules["vllm"] = None`)."""
    script = str(REPO_ROOT / "benchmarks" / name)
    code = (
        "import runpy, sys; sys.modules['vllm'] = None; "
        f"sys.argv = [{name!r}, *{list(args)!r}]; "
        f"runpy.run_path({script!r}, run_name='__main__')"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_step_bench_runs_every_case_without_vllm(tmp_path):
    run_without_vllm("step_bench.py", "--smoke", "--out", str(tmp_path))

    result = json.loads((tmp_path / "results.json").read_text())
    assert {"device", "torch", "shape", "cases", "op_counts", "sparse_reuse_attention"} <= set(result)
    cases = {c["case"] for c in result["cases"]}
    assert {"refresh", "reuse", "llada2_step", "head_T0", "head_T1"} <= cases
    for case in result["cases"]:
        assert set(case) == {"case", "requests", "context", "ours_ms", "ideal_ms", "ratio", "reps"}
        assert case["reps"] == 1  # --smoke's one repetition
        assert case["ours_ms"] > 0 and case["ideal_ms"] > 0
        assert abs(case["ratio"] - case["ours_ms"] / case["ideal_ms"]) <= 0.01 * case["ratio"] + 1e-3
    for kind in ("llada", "llada2"):
        counts = [r for r in result["op_counts"] if r["kind"] == kind]
        assert {r["requests"] for r in counts} == {1, 4, 16}
        # One engine step dispatches as many ops at 16 requests as at 1.
        assert len({r["ops_per_step"] for r in counts}) == 1
        # So does an engine call of several steps (as many at every size), with at
        # most two syncs a step (the candidate count, the check before the next).
        assert len({(r["call_steps"], r["ops_per_call"]) for r in counts}) == 1
        assert counts[0]["call_steps"] > 1
        assert counts[0]["sync_ops_per_call"] <= 2 * counts[0]["call_steps"]
    sparse = result["sparse_reuse_attention"]
    assert sparse and sparse[0]["sparse"]["seq_len"] < sparse[0]["dense"]["seq_len"]
    assert (tmp_path / "table.md").read_text().startswith("Device: ")


def test_later_steps_runs_every_way_without_vllm(tmp_path):
    """benchmarks/later_steps.py (run on GPU machines): every rule, size and way."""
    run_without_vllm("later_steps.py", "--smoke", "--out", str(tmp_path))
    rows = json.loads((tmp_path / "results.json").read_text())["later_steps"]
    assert {(r["kind"], r["requests"]) for r in rows} == {("llada", 1), ("llada", 4), ("llada2", 1), ("llada2", 4)}
    assert all(r[f"{mode}_ms"] > 0 for r in rows for mode in ("step_graphs", "reuse_graphs", "one_step_calls"))
    assert "| whole-step graphs |" in (tmp_path / "table.md").read_text()


def test_profile_step_runs_without_vllm(tmp_path):
    """benchmarks/profile_step.py (run on GPU machines, which have no vLLM) profiles
    both sides of a case and writes their tables and a summary."""
    run_without_vllm("profile_step.py", "--small", "--cases", "1x256", "--steps", "1", "--out", str(tmp_path))
    (row,) = json.loads((tmp_path / "summary.json").read_text())
    assert (row["case"], row["requests"], row["context"], row["cuda_graphs"]) == ("1x256", 1, 256, False)
    for side in ("ours", "ideal"):
        assert row[side]["wall_ms_per_step"] > 0
        assert "aten::" in (tmp_path / f"1x256-{side}-by-host.txt").read_text()
