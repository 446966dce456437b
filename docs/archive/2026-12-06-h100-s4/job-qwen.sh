#!/usr/bin/env bash
# serving, four formats, the prefill cap (s4kv serve's default), Qwen2.5-7B shape; CPU sampled
cd "$(dirname "$0")/.."
date -u; nvidia-smi --query-gpu=name,memory.free --format=csv,noheader
(while true; do date -u +%T; top -b -n1 -w 200 | sed -n 7,16p; sleep 5; done) > "$OUT/top.log" 2>&1 &
sampler=$!
LIMIT_S=${LIMIT_S:-575} bash tools/device/bench.sh serve --model configs/qwen2.5-7b-instruct.json \
  --configs bf16_fa3,fp8_fa3,s4kv_kivi,s4kv_saw --rates 8,16,24 --concurrency 48 --requests 48 \
  --input-len 2048 --output-len 256 --kv-cache-memory-bytes 2147483648 --gpu-memory-utilization 0.2 \
  --max-model-len 4096 --prefill-tokens-per-step 2048 > "$OUT/serve.log" 2>&1
echo "serve rc=$?"
kill $sampler
grep "\[serve\]" "$OUT/serve.log"
tail -2 "$OUT/serve.log"
date -u
