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
#   bash benchmarks/gpu_session.sh train   # issue 27's converted LLaDA2 run on CUDA for
#                                          #  TRAIN_MINUTES (default 8): resumed on the same warm
#                                          #  machine, else from TRAIN_FROM (carried weights.pt of
#                                          #  `train --export-weights`), else from the shipped
#                                          #  vllm_dllm/llada2_model, else converted anew; brings
#                                          #  back the checkpoint (bf16), the log and weights.pt
#   bash benchmarks/gpu_session.sh train-matrix  # issue 27 on one call: the main LLaDA2 run
#                                          #  (every task, lookup, retrieval-weighted, balanced
#                                          #  gradients), lookup alone, and the reading tasks
#                                          #  (retrieval, lookup, copy, reverse) side by side on the
#                                          #  one GPU for TRAIN_MINUTES (default 7.5), from scratch;
#                                          #  brings back the main run's float32 checkpoint and
#                                          #  every run's log
#   bash benchmarks/gpu_session.sh lookup-probes  # six small-model runs of the multi-query
#                                          #  lookup (`recall`) side by side for TRAIN_MINUTES
#                                          #  (default 3): which settings let the matching form;
#                                          #  brings back their logs
#
# `check` first: it fails in seconds where the long run would fail after minutes.
# The device tool brings back only a few files per call, so on that machine ($OUT set)
# a stage leaves one archive, $OUT/<stage>.tgz.  Commit what it holds under
# benchmarks/results/step-gpu/ (see its README.md for the first run) and name the device.
set -uo pipefail
stage=${1:?usage: gpu_session.sh check|bench|profile|train|train-matrix|lookup-probes}
case "$stage" in check|bench|profile|train|train-matrix|lookup-probes) ;;
*) echo "unknown stage $stage: check, bench, profile, train, train-matrix or lookup-probes" >&2; exit 2 ;; esac
out=${OUT:-/tmp/gpu-session}/$stage
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}  # the GPU machine's python3 holds torch
runs=${RUNS_DIR:-runs}  # where training stages keep their states
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
    # The converted LLaDA2 run (docs/training-log.md, session 16: the only start that
    # formed retrieval's lookup), continued on CUDA: resumed from $runs/gpu-conv that an
    # earlier call left on the same warm machine; else started from TRAIN_FROM, a file
    # of `train --export-weights` carried to the machine (a CPU run's weights and task
    # levels; the full state is over the 64 MiB a call carries); else converted anew
    # from the shipped LLaDA model.  It brings back the bf16 checkpoint, the log and
    # weights.pt, which the next session's --init-from (CPU or GPU) continues from.
    # Without TRAIN_FROM it continues the LLaDA2 model the package ships (its weights and
    # curriculum levels: the lineage git carries), or converts the LLaDA model if none
    # (4 layers: then TRAIN_ARGS="--layers 4", or the conversion refuses the shape).
    if [ -f "$runs/gpu-conv/state.pt" ]; then start=(--resume)
    elif [ -n "${TRAIN_FROM:-}" ]; then start=(--init-from "$TRAIN_FROM")
    elif [ -f vllm_dllm/llada2_model/model.safetensors ]; then start=(--init-from vllm_dllm/llada2_model)
    else start=(--init-from vllm_dllm/default_model); fi
    # Three times the CPU run's rows per step (--batch-scale 2 against 0.67): a step of this
    # model is kernel launches, so on an H200 it still ran at ~8.7 steps/s (session 19).
    # The data are those of the shipped model's last run (padmul2, docs/training-log.md,
    # session 43): multiply writes its working padded to six digits and padded_sum trains
    # the in-answer sum that layout makes learnable (session 41); half of multiply's and
    # sort's batches from their hard part (two-digit multipliers, the longer lists); half of
    # multiply's working masked sum-first and half of the rows asking for the sum with the
    # partial products altered (sessions 39-40); addition and sort weighted up to hold
    # them at target while multiply gains; no curriculum (every level is at full size).
    # The 8-layer model continues at 5e-5 (a restart at 3e-4 shook it for hundreds of
    # steps).  TRAIN_ARGS overrides any of these.
    conv=(--arch llada2 --out "$runs/gpu-conv" --tasks every,padded_sum --hidden 192 --layers 8 --heads 3 --kv-heads 3
          --intermediate 576 --experts 16 --experts-per-token 4 --expert-groups 4 --topk-groups 2
          --moe-intermediate 144 --shared-experts 4 --rope-theta 10000 --steps 40000 --lr 5e-5 --warmup 100
          --batch-scale 2 --batch-sizes retrieval=48
          --task-weights retrieval=1,addition=4,sort=8,multiply=5,chain=4,brackets=2,padded_sum=3
          --focus-share multiply=0.5,sort=0.5 --balance-tasks
          --working-first-share 0.5 --altered-working-share 0.5
          --eval-every 1000 --eval-n 24 --save-every 200)
    # shellcheck disable=SC2086
    "$py" -m lab.train "${conv[@]}" "${start[@]}" --device "${TRAIN_DEVICE:-cuda}" --threads "${TRAIN_THREADS:-8}" \
        --minutes "${TRAIN_MINUTES:-8}" ${TRAIN_ARGS:-} 2>&1 | tee "$out/train.log" \
        | grep -iE '"accuracy"|"level"|resumed|initialised|wrote|error'
    trained=${PIPESTATUS[0]}
    "$py" -m lab.train "${conv[@]}" --export-weights "$out/weights.pt" && \
        cp -r "$runs/gpu-conv/model" "$runs/gpu-conv/train_log.jsonl" "$out/"
    copied=$?
    [ "$trained" -eq 0 ] && [ "$copied" -eq 0 ]
    ;;
train-matrix)
    # Small models leave the GPU idle between kernel launches, so three runs share it.
    # main: the shipped candidate; lookup: the lookup alone at the main shape (does it
    # ever form given GPU-many steps?); focus: the reading tasks alone.
    shape=(--arch llada2 --hidden 192 --layers 4 --heads 4 --kv-heads 2 --intermediate 576 --experts 16
           --experts-per-token 4 --expert-groups 4 --topk-groups 2 --moe-intermediate 128 --rope-theta 10000
           --steps 40000 --lr 2e-3 --warmup 200 --embedding-std 1.0 --curriculum-threshold 0.9 --eval-n 24
           --save-every 1000 --device "${TRAIN_DEVICE:-cuda}" --threads 4 --minutes "${TRAIN_MINUTES:-7.5}")
    declare -A config=(
        [main]="--tasks every,lookup --batch-scale 1.5 --batch-sizes retrieval=64,lookup=128
                --task-weights retrieval=3,lookup=3,chain=2,addition=2,sort=2,multiply=2 --balance-tasks
                --eval-every 2000 --checkpoint-dtype float32"
        [lookup]="--tasks lookup --batch-sizes lookup=256 --eval-every 1000"
        [focus]="--tasks retrieval,lookup,copy,reverse --batch-sizes retrieval=64,lookup=128
                 --task-weights retrieval=2,lookup=2 --balance-tasks --eval-every 1000"
    )
    for name in "${!config[@]}"; do
        rm -rf "$runs/gpu-$name"  # from scratch: no earlier log to append to
        # shellcheck disable=SC2086
        "$py" -m lab.train "${shape[@]}" --out "$runs/gpu-$name" ${config[$name]} \
            >"$out/$name.log" 2>&1 &
    done
    sleep "${TRAIN_PEEK_S:-90}"
    for name in "${!config[@]}"; do echo "== $name after ${TRAIN_PEEK_S:-90} s"; tail -n 2 "$out/$name.log"; done
    failed=0
    for job in $(jobs -p); do wait "$job" || failed=1; done
    for name in "${!config[@]}"; do
        echo "== $name"; grep -E '"accuracy"|wrote|Error|error' "$out/$name.log" | tail -n 4
        cp "$runs/gpu-$name/train_log.jsonl" "$out/$name.jsonl" 2>/dev/null
    done
    cp -r "$runs/gpu-main/model" "$out/main-model" 2>/dev/null
    [ "$failed" -eq 0 ]
    ;;
lookup-probes)
    # The small model of the CPU probes (docs/training-log.md, session 16); each run
    # changes one thing against `base` (embeddings at the default std 0.02).
    small=(--arch llada2 --tasks recall --hidden 96 --layers 4 --heads 2 --kv-heads 2 --intermediate 288
           --experts 4 --experts-per-token 2 --expert-groups 2 --topk-groups 1 --moe-intermediate 64
           --rope-theta 10000 --steps 20000 --warmup 100 --batch-sizes recall=128 --curriculum-threshold 0.9
           --eval-every 100000 --save-every 100000 --device "${TRAIN_DEVICE:-cuda}" --threads 2
           --minutes "${TRAIN_MINUTES:-3}")
    declare -A config=(
        [base]="--lr 2e-3" [mimetic]="--lr 2e-3 --mimetic-qk 0.1" [lr5e-3]="--lr 5e-3"
        [noedit]="--lr 2e-3 --edit-ratio 0" [emb1]="--lr 2e-3 --embedding-std 1.0"
        [dense]="--lr 2e-3 --dense-layers 3"
    )
    for name in "${!config[@]}"; do
        rm -rf "$runs/probe-$name"
        # shellcheck disable=SC2086
        "$py" -m lab.train "${small[@]}" --out "$runs/probe-$name" ${config[$name]} >"$out/$name.log" 2>&1 &
    done
    failed=0
    for job in $(jobs -p); do wait "$job" || failed=1; done
    for name in "${!config[@]}"; do
        tail -n 1 "$out/$name.log"; cp "$runs/probe-$name/train_log.jsonl" "$out/$name.jsonl" 2>/dev/null
    done
    [ "$failed" -eq 0 ]
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
