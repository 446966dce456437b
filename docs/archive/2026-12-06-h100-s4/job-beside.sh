#!/usr/bin/env bash
# kivi stream bursts: int4_kivi beside an int4_saw server on vLLM's default runner, CPU per process sampled
cd "$(dirname "$0")/.."
date -u
common="--model configs/llama-3.1-8b-instruct.json --requests 48 --input-len 2048 --output-len 256 \
  --kv-cache-memory-bytes 4294967296 --gpu-memory-utilization 0.2 --max-model-len 4096 --prefill-tokens-per-step 2048"
base=$OUT
mkdir -p "$base/beside"
(while true; do date -u +%T; top -b -n1 -w 200 | sed -n 7,20p; sleep 4; done) > "$base/beside/top.log" 2>&1 &
sampler=$!
OUT=$base/beside LIMIT_S=300 bash tools/device/bench.sh serve \
  --configs s4kv_saw,s4kv_kivi --rates 12 --concurrency 48 $common > "$base/beside/serve.log" 2>&1
echo "beside rc=$?"
kill $sampler
grep "\[serve\]" "$base/beside/serve.log"; tail -2 "$base/beside/serve.log"
ps -eo pid,pcpu,nlwp,args --sort=-pcpu | cut -c1-160 | head -12
date -u
