#!/usr/bin/env bash
# max_num_seqs 17 (bf16's KV-bound count, off vLLM's capture stride) with 17 added to the CUDA-graph capture sizes,
# every format; then int4_kivi at 17 without it (the 10:26 job's setting), same machine
cd "$(dirname "$0")/.."
date -u; nvidia-smi --query-gpu=name,memory.free --format=csv,noheader
base=$OUT
common="--model configs/qwen2.5-7b-instruct.json --requests 48 --input-len 2048 --output-len 256 \
  --kv-cache-memory-bytes 2147483648 --gpu-memory-utilization 0.2 --max-model-len 4096 --max-num-seqs 17 \
  --prefill-tokens-per-step 2048"
mkdir -p "$base/graphs17" "$base/kivi17"
OUT=$base/graphs17 LIMIT_S=400 bash tools/device/bench.sh serve --configs bf16_fa3,fp8_fa3,s4kv_kivi,s4kv_saw \
  --rates 8,16,24 --concurrency 48 $common --server-arg=--cudagraph-capture-sizes \
  --server-arg=1 --server-arg=2 --server-arg=4 --server-arg=8 --server-arg=16 --server-arg=17 --server-arg=24 \
  --server-arg=32 > "$base/graphs17/serve.log" 2>&1
echo "graphs17 rc=$?"
grep "\[serve\]" "$base/graphs17/serve.log"; tail -2 "$base/graphs17/serve.log"
grep -h "Capturing CUDA graphs (decode" /tmp/s4kv-serve/logs/serve-s4kv_kivi.log | grep -o "[0-9]*/[0-9]* \[" | tail -1
left=$((585 - SECONDS)); echo "left $left s"
if [ "$left" -gt 150 ]; then
  OUT=$base/kivi17 LIMIT_S=$left bash tools/device/bench.sh serve --configs s4kv_kivi --rates 8 --concurrency 48 \
    $common > "$base/kivi17/serve.log" 2>&1
  echo "kivi17 rc=$?"; grep "\[serve\]" "$base/kivi17/serve.log"; tail -2 "$base/kivi17/serve.log"
fi
date -u
