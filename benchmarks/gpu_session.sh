#!/usr/bin/env bash
# What a session does with the GPU machine when one is lent (../shared/GPU.md: torch,
# triton, numpy and pytest, but no vLLM and no network), as the device tool's `run`
# command, which has a 10-minute limit per call and writes results under $OUT:
#
#   bash benchmarks/gpu_session.sh check   # ~1 min: step_bench at toy sizes on CUDA
#                                          #  (every case and branch), then the Triton
#                                          #  kernels compiled, against their torch references,
#                                          #  the start-up self-check (worker/self_check.py)
#                                          #  and the vocabulary-parallel rules on CUDA
#   bash benchmarks/gpu_session.sh bench   # the LLaDA-8B-shaped step_bench (bf16), ~2 min
#   bash benchmarks/gpu_session.sh profile # where the step's time goes (profile_step.py) and
#                                          #  the Triton KV-tile sweep (triton_tile_sweep.py), ~3 min
#   bash benchmarks/gpu_session.sh train   # issue 27's LLaDA2-format task model on CUDA: the
#                                          #  CPU run's command (docs/training-log.md, run 2) for
#                                          #  TRAIN_MINUTES (default 8) from scratch, or resumed from
#                                          #  runs/gpu-run that an earlier call left on the same warm
#                                          #  machine; brings back the checkpoint (bf16) and the log
#
# `check` first: it fails in seconds where the long run would fail after minutes.
# The device tool brings back only a few files per call, so on that machine ($OUT set)
# a stage leaves one archive, $OUT/<stage>.tgz.  Commit what it holds under
# benchmarks/results/step-gpu/ (see its README.md for the first run) and name the device.
set -uo pipefail
stage=${1:?usage: gpu_session.sh check|bench|profile|train}
case "$stage" in check|bench|profile|train) ;; *) echo "unknown stage $stage: check, bench, profile or train" >&2; exit 2 ;; esac
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
    "$py" -m pytest -q -p no:cacheprovider tests/test_step_bench.py tests/test_triton_attention.py \
        tests/test_vocab_parallel.py \
        tests/test_philox.py 2>&1 | tee "$out/triton-tests.log"
    fi
    ;;
bench)
    "$py" benchmarks/step_bench.py --out "$out/step-gpu" 2>&1 | tee "$out/step-gpu.log"
    ;;
profile)
    "$py" benchmarks/profile_step.py --out "$out/profile" 2>&1 | tee "$out/profile.log"
    "$py" benchmarks/triton_tile_sweep.py --out "$out/tile-sweep" 2>&1 | tee "$out/tile-sweep.log"
    ;;
train)
    # The state (weights and optimizer, ~65 MB) stays on the machine for the next call's
    # --resume: only files under 16 MiB come back, so the bf16 checkpoint does.  The
    # command is the CPU runs' (docs/training-log.md) with --steps 40000, without run 2's
    # later task weights (TRAIN_ARGS adds options; a later one wins).  A failed run leaves
    # the stage failing even where an earlier call's checkpoint is still there to copy.
    "$py" -m vllm_dllm.tools.train --arch llada2 --out runs/gpu-run --tasks every --hidden 192 --layers 4 \
        --heads 4 --kv-heads 2 --intermediate 576 --experts 16 --experts-per-token 4 --expert-groups 4 \
        --topk-groups 2 --moe-intermediate 128 --rope-theta 10000 --steps 40000 --lr 2e-3 --warmup 200 \
        --batch-scale 0.67 --embedding-std 1.0 --curriculum-threshold 0.9 --eval-every 1000 --eval-n 24 \
        --save-every 200 --device cuda --threads 8 --resume --minutes "${TRAIN_MINUTES:-8}" \
        ${TRAIN_ARGS:-} 2>&1 | tee "$out/train.log" | grep -iE '"accuracy"|resumed|wrote|error'
    trained=${PIPESTATUS[0]}
    cp -r runs/gpu-run/model runs/gpu-run/train_log.jsonl "$out/"
    [ "$trained" -eq 0 ]
    ;;
esac
status=$?
if [ -n "${OUT:-}" ]; then
    tar czf "$OUT/$stage.tgz" -C "$OUT" "$stage" && rm -rf "$out"
fi
exit $status
