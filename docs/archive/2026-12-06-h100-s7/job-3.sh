#!/usr/bin/env bash
# End to end at HEAD, Llama-3.1-8B shape, every format, short and long
cd "$(dirname "$0")/.."
date -u; nvidia-smi --query-gpu=name,memory.free --format=csv,noheader
LIMIT_S=585 bash tools/device/bench.sh e2e --in-order --model configs/llama-3.1-8b-instruct.json \
  --configs bf16_fa3,fp8_fa3,s4kv_saw,s4kv_kivi --workloads short,long > "$OUT/e2e.log" 2>&1
echo "e2e rc=$?"
tail -40 "$OUT/e2e.log"
date -u
