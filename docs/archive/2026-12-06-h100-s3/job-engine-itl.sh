#!/usr/bin/env bash
# the engine's own ITL beside the client's: capped kivi + saw, then default kivi + bf16, at 12/s and 24-48 in flight
cd "$(dirname "$0")/.."
date -u; nvidia-smi --query-gpu=name,memory.free --format=csv,noheader
common="--model configs/llama-3.1-8b-instruct.json --requests 48 --input-len 2048 --output-len 256 \
  --kv-cache-memory-bytes 4294967296 --gpu-memory-utilization 0.2 --max-model-len 4096"
base=$OUT
mkdir -p "$base/capped" "$base/default"
OUT=$base/capped LIMIT_S=300 bash tools/device/bench.sh serve --configs s4kv_kivi,s4kv_saw --rates 12 \
  --concurrency 24,48 --prefill-tokens-per-step 2048 $common > "$base/capped/serve.log" 2>&1
echo "capped rc=$?"
OUT=$base/default LIMIT_S=240 bash tools/device/bench.sh serve --configs s4kv_kivi,bf16_fa3 --rates 12 \
  --concurrency 48 $common > "$base/default/serve.log" 2>&1
echo "default rc=$?"
for d in capped default; do echo "=== $d"; grep "\[serve\]" "$base/$d/serve.log"; tail -2 "$base/$d/serve.log"; done
date -u
