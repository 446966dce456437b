#!/usr/bin/env bash
# Decode kernels at HEAD (both shapes, batch 1/32/256 x 1k/4k/32k, FA3 bf16 and fp8 beside), the joint row sums
# option timed against the committed launch of each scheme
cd "$(dirname "$0")/.."
date -u; nvidia-smi --query-gpu=name,memory.free --format=csv,noheader
KERNEL_ARGS="--batches 1,32,256 --contexts 1024,4096,32768 --methods fa3_bf16,fa3_fp8,s4kv_kivi,s4kv_saw \
 --launch s4kv_kivi_jrs=int4_kivi:joint_row_sums=true --launch s4kv_saw_jrs=int4_saw:joint_row_sums=true" \
  LIMIT_S=400 bash tools/device/bench.sh kernels > "$OUT/k.log" 2>&1
echo "kernels rc=$?"
cat "$OUT/kernels.md" 2>/dev/null | head -90
date -u
