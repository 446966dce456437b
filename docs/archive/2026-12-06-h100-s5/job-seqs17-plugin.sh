#!/usr/bin/env bash
# max_num_seqs 17 through the committed s4kv serve server (capture sizes added by the plugin), every format
cd "$(dirname "$0")/.."
date -u; nvidia-smi --query-gpu=name,memory.free --format=csv,noheader
LIMIT_S=560 bash tools/device/bench.sh serve --model configs/qwen2.5-7b-instruct.json \
  --configs bf16_fa3,fp8_fa3,s4kv_kivi,s4kv_saw --rates 8,16,24 --concurrency 48 --requests 48 \
  --input-len 2048 --output-len 256 --kv-cache-memory-bytes 2147483648 --gpu-memory-utilization 0.2 \
  --max-model-len 4096 --max-num-seqs 17 --prefill-tokens-per-step 2048 > "$OUT/serve.log" 2>&1
echo "serve rc=$?"
grep "\[serve\]" "$OUT/serve.log"; tail -2 "$OUT/serve.log"
for f in /tmp/s4kv-serve/logs/*.log; do
  echo "== $f"; grep -h "CUDA-graph capture sizes" "$f" | cut -c1-220
  grep -h "Capturing CUDA graphs" "$f" | grep -o "Capturing CUDA graphs ([^)]*): 100%[^[]*" | sort -u
done
date -u
