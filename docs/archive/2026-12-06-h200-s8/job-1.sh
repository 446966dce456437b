#!/usr/bin/env bash
# Shortest: decode kernels at HEAD at batch 256 x 32k (both shapes), FA3 bf16 beside, each scheme with its row sums in
# two reductions beside its DECODE_LAUNCH
cd "$(dirname "$0")/.."
date -u; nvidia-smi --query-gpu=name,memory.free --format=csv,noheader
. tools/device/env.sh
date -u
python3 tools/device/bench_kernels.py --out "$OUT" --budget-s $((${LIMIT_S:-200} - SECONDS - 40)) --batches 256 \
  --contexts 32768 --methods fa3_bf16,s4kv_kivi,s4kv_saw --no-store \
  --launch s4kv_kivi_sep=int4_kivi:joint_row_sums=false --launch s4kv_saw_sep=int4_saw:joint_row_sums=false \
  > "$OUT/k.log" 2>&1
echo "kernels rc=$?"
cat "$OUT/kernels.md" 2>/dev/null | head -30
tail -3 "$OUT/k.log"
date -u
