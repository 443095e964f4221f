#!/bin/bash
cd /work/main
for round in 1 2; do
 for cfg in "32 bfloat16" "32 float32" "1 bfloat16"; do
  set -- $cfg
  for tree in /tmp/oldtree /work/main; do
    PYTHONPATH=$tree python benchmarks/engine_overhead.py --label ab --out /tmp/ab-out --settings default --repeats 3 --dtype $2 --num-requests $1 > /tmp/ab-one.log 2>&1
    w=$(grep "vllm_dllm in the worker" /tmp/ab-one.log | head -1 | awk '{print $NF}')
    r=$(grep "^| default" /tmp/ab-one.log | head -1 | awk -F'|' '{print $6, $12}')
    echo "round $round n=$1 $2 tree=$tree worker=$w : $r"
  done
 done
done
