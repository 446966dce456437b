#!/usr/bin/env bash
# End to end at HEAD, Llama-3.1-8B shape, the many-users workload (1024 x 2048 / 512, max_num_seqs 1024)
cd "$(dirname "$0")/.."
date -u; nvidia-smi --query-gpu=name,memory.free --format=csv,noheader
LIMIT_S=590 bash tools/device/bench.sh e2e --in-order --model configs/llama-3.1-8b-instruct.json \
  --configs bf16_fa3,s4kv_kivi,s4kv_saw,fp8_fa3 --workloads many > "$OUT/e2e.log" 2>&1
echo "e2e rc=$?"
tail -25 "$OUT/e2e.log"
date -u
