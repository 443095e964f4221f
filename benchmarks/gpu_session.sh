#!/usr/bin/env bash
# What a session does with the GPU machine when one is lent (../shared/GPU.md: torch,
# triton, numpy and pytest, but no vLLM and no network), as the device tool's `run`
# command, which has a 10-minute limit per call and writes results under $OUT:
#
#   bash benchmarks/gpu_session.sh check   # ~1 min: step_bench at toy sizes on CUDA
#                                          #  (every case and branch), then the Triton
#                                          #  kernels compiled, against their torch references,
#                                          #  the start-up self-check (worker/self_check.py),
#                                          #  the vocabulary-parallel rules and whole-step
#                                          #  CUDA graphs (tests/unit/test_step_graphs.py)
#   bash benchmarks/gpu_session.sh bench   # the LLaDA-8B-shaped step_bench (bf16), with candidate
#                                          #  windows and with listed candidates, then
#                                          #  later_steps.py (whole-step graphs), ~6 min
#   bash benchmarks/gpu_session.sh profile # where the step's time goes (profile_step.py) and
#                                          #  the Triton KV-tile sweep (triton_tile_sweep.py), ~3 min
#
# `check` first: it fails in seconds where the long run would fail after minutes.
# The device tool brings back only a few files per call, so on that machine ($OUT set)
# a stage leaves one archive, $OUT/<stage>.tgz.  Commit what it holds under
# benchmarks/results/step-gpu/ (see its README.md for the first run) and name the device.
set -uo pipefail
stage=${1:?usage: gpu_session.sh check|bench|profile}
case "$stage" in check|bench|profile) ;;
*) echo "unknown stage $stage: check, bench or profile" >&2; exit 2 ;; esac
out=${OUT:-/tmp/gpu-session}/$stage
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}  # the GPU machine's python3 holds torch
cd "$(dirname "$0")/.."
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$py" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } \
    2>&1 | tee "$out/device.txt"

case "$stage" in
check)
    if ! "$py" benchmarks/step_bench.py --smoke --out "$out/smoke" 2>&1 | tee "$out/smoke.log"; then
        false  # the long checks would fail the same way: stop, keep the log
    else
    # The serving warm-up's self-check (Triton/flash attention + CUDA graphs, Triton
    # Philox, against the torch references) on a plain-torch model, in bf16 and fp32.
    for dtype in bfloat16 float32; do
        "$py" -m vllm_dllm.worker.self_check --dtype $dtype 2>&1 | tee -a "$out/self-check.log"
    done
    "$py" -m pytest -q -p no:cacheprovider tests/benchmarks/test_step_bench.py tests/unit/test_triton_attention.py \
        tests/unit/test_vocab_parallel.py tests/unit/test_philox.py \
        tests/unit/test_step_graphs.py::test_real_cuda_graphs_stream_the_tokens_of_reuse_graphs_alone \
        2>&1 | tee "$out/triton-tests.log"
    fi
    ;;
bench)
    "$py" benchmarks/step_bench.py --out "$out/step-gpu" 2>&1 | tee "$out/step-gpu.log"
    # A call's later steps: whole-step graphs, Reuse graphs alone, one step a call.
    "$py" benchmarks/later_steps.py --out "$out/later-steps" 2>&1 | tee "$out/later-steps.log"
    # The same with each step's candidates listed (a sync before the LM head) instead
    # of CUDA's default candidate windows: the reuse and llada2_step rows side by side.
    "$py" benchmarks/step_bench.py --candidate-rows --out "$out/step-gpu-candidate-rows" 2>&1 \
        | tee "$out/step-gpu-candidate-rows.log"
    ;;
profile)
    "$py" benchmarks/profile_step.py --out "$out/profile" 2>&1 | tee "$out/profile.log"
    "$py" benchmarks/triton_tile_sweep.py --out "$out/tile-sweep" 2>&1 | tee "$out/tile-sweep.log"
    ;;
esac
status=$?
if [ -n "${OUT:-}" ]; then
    # Files come back only up to 16 MiB each: a larger archive comes back in parts
    # (cat $stage.tgz.part-* > $stage.tgz).
    tar czf "$OUT/$stage.tgz" -C "$OUT" "$stage" && rm -rf "$out"
    if [ -f "$OUT/$stage.tgz" ] && [ "$(stat -c %s "$OUT/$stage.tgz")" -gt $((15 * 1024 * 1024)) ]; then
        split -b 15M "$OUT/$stage.tgz" "$OUT/$stage.tgz.part-" && rm "$OUT/$stage.tgz"
    fi
fi
exit $status
