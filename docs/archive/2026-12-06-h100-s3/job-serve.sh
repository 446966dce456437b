#!/usr/bin/env bash
# serving: four formats, vLLM's scheduler (waves), JIT column
cd "$(dirname "$0")/.."
date -u; nvidia-smi --query-gpu=name,memory.free --format=csv,noheader
LIMIT_S=${LIMIT_S:-575} bash tools/device/bench.sh serve --model configs/llama-3.1-8b-instruct.json \
  --configs bf16_fa3,fp8_fa3,s4kv_kivi,s4kv_saw --rates 4,8,12 --concurrency 48 --requests 48 \
  --input-len 2048 --output-len 256 --kv-cache-memory-bytes 4294967296 --gpu-memory-utilization 0.2 \
  --max-model-len 4096 ${EXTRA:-} > "$OUT/serve.log" 2>&1
echo "serve rc=$?"
grep "\[serve\]" "$OUT/serve.log" | head -12
tail -3 "$OUT/serve.log"
cat "$OUT/serve.md" 2>/dev/null
for f in /tmp/s4kv-serve/logs/*.log; do
  echo "== $f"; grep -i "eager-step\|JIT compilation during\|out of memory\|Error" "$f" | cut -c1-220 | head -8
done
date -u
