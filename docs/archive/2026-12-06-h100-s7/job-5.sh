#!/usr/bin/env bash
# End to end at HEAD, Qwen2.5-7B shape, short, as many formats as fit
cd "$(dirname "$0")/.."
date -u
LIMIT_S=${LIMIT_S:-280} bash tools/device/bench.sh e2e --in-order --model configs/qwen2.5-7b-instruct.json \
  --configs bf16_fa3,s4kv_saw,s4kv_kivi,fp8_fa3 --workloads short > "$OUT/e2e.log" 2>&1
echo "e2e rc=$?"
tail -16 "$OUT/e2e.log"
date -u
