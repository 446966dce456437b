#!/usr/bin/env bash
# H200: end to end, Llama-3.1-8B shape, every format, short + long, at the current kernels.
# H100: serving at equal running counts (max_num_seqs 17 for every format, bf16's KV-bound count), Qwen2.5-7B
#       shape; then int4_saw on vLLM's V1 runner, one serving point (kernels compiled after start-up?)
cd "$(dirname "$0")/.."
date -u; gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$gpu"
if [[ "$gpu" == *H200* ]]; then
  LIMIT_S=585 bash tools/device/bench.sh e2e --in-order --model configs/llama-3.1-8b-instruct.json \
    --configs bf16_fa3,fp8_fa3,s4kv_saw,s4kv_kivi --workloads short,long > "$OUT/e2e.log" 2>&1
  echo "e2e rc=$?"; tail -30 "$OUT/e2e.log"; date -u; exit 0
fi
base=$OUT
mkdir -p "$base/equal" "$base/saw_v1"
OUT=$base/equal LIMIT_S=390 bash tools/device/bench.sh serve --model configs/qwen2.5-7b-instruct.json \
  --configs bf16_fa3,fp8_fa3,s4kv_kivi,s4kv_saw --rates 8,16,24 --concurrency 48 --requests 48 \
  --input-len 2048 --output-len 256 --kv-cache-memory-bytes 2147483648 --gpu-memory-utilization 0.2 \
  --max-model-len 4096 --max-num-seqs 17 --prefill-tokens-per-step 2048 > "$base/equal/serve.log" 2>&1
echo "equal rc=$?"
grep "\[serve\]" "$base/equal/serve.log"; tail -2 "$base/equal/serve.log"
left=$((580 - SECONDS))
echo "left $left s"
if [ "$left" -gt 150 ]; then
  OUT=$base/saw_v1 VLLM_USE_V2_MODEL_RUNNER=0 LIMIT_S=$left bash tools/device/bench.sh serve \
    --model configs/qwen2.5-7b-instruct.json --configs s4kv_saw --rates 16 --concurrency "" --requests 48 \
    --input-len 2048 --output-len 256 --kv-cache-memory-bytes 2147483648 --gpu-memory-utilization 0.2 \
    --max-model-len 4096 --prefill-tokens-per-step 2048 > "$base/saw_v1/serve.log" 2>&1
  echo "saw_v1 rc=$?"
  grep "\[serve\]" "$base/saw_v1/serve.log"; tail -2 "$base/saw_v1/serve.log"; cat "$base/saw_v1/serve.md" 2>/dev/null | head -20
  for f in /tmp/s4kv-serve/logs/*.log; do echo "== $f"; grep -i "JIT compilation during\|compil" "$f" | cut -c1-220 | head -8; done
fi
date -u
