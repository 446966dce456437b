#!/usr/bin/env bash
# kivi stream bursts: (A) every server on vLLM's V1 runner; (B) int4_kivi with a 0.5 ms GIL switch interval
cd "$(dirname "$0")/.."
date -u; nvidia-smi --query-gpu=name,memory.free --format=csv,noheader
common="--model configs/llama-3.1-8b-instruct.json --requests 48 --input-len 2048 --output-len 256 \
  --kv-cache-memory-bytes 4294967296 --gpu-memory-utilization 0.2 --max-model-len 4096 --prefill-tokens-per-step 2048"
base=$OUT
mkdir -p "$base/v1runner" "$base/switch"
OUT=$base/v1runner VLLM_USE_V2_MODEL_RUNNER=0 LIMIT_S=330 bash tools/device/bench.sh serve \
  --configs bf16_fa3,s4kv_kivi,s4kv_saw --rates 12 --concurrency 48 $common > "$base/v1runner/serve.log" 2>&1
echo "v1runner rc=$?"
mkdir -p /tmp/gil
cat > /tmp/gil/sitecustomize.py <<'PY'
import os, sys
sys.setswitchinterval(0.0005)
with open("/tmp/gil/pids", "a") as f:
    f.write(f"{os.getpid()} {sys.getswitchinterval()}\n")
PY
OUT=$base/switch PYTHONPATH=/tmp/gil LIMIT_S=$((560 - SECONDS)) bash tools/device/bench.sh serve \
  --configs s4kv_kivi --rates 12 --concurrency 48 $common > "$base/switch/serve.log" 2>&1
echo "switch rc=$? processes=$(wc -l < /tmp/gil/pids)"
for d in v1runner switch; do echo "=== $d"; grep "\[serve\]" "$base/$d/serve.log"; tail -2 "$base/$d/serve.log"; cat "$base/$d/serve.md" 2>/dev/null | head -30; done
for f in /tmp/s4kv-serve/logs/*.log; do
  echo "== $f"; grep -i "JIT compilation during\|out of memory\|Error" "$f" | cut -c1-220 | head -5
done
date -u
