#!/usr/bin/env bash
# int4_kivi end to end at 3 and 5 decode stages, in the order 3, 5, bf16 + FA3, 5, 3, Qwen2.5-7B shape, short.
# Run from the repository root of a tree whose int4_kivi DECODE_LAUNCH has 3 stages (the copy in /tmp/k5 gets 5);
# carry .vlb and this script. Back in $OUT: one results.json per engine and every engine log.
set -uo pipefail
. tools/device/env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
rm -rf /tmp/k5 && mkdir /tmp/k5 && cp -r runtime kernels tools configs /tmp/k5/ 2>/dev/null
cp -r models /tmp/k5/ 2>/dev/null || true
sed -i 's/LaunchConfig(tile=128, num_warps=4, num_stages=3, subnormal_codes=True/LaunchConfig(tile=128, num_warps=4, num_stages=5, subnormal_codes=True/' /tmp/k5/kernels/attention.py
grep -n '"int4_kivi": LaunchConfig' /tmp/k5/kernels/attention.py kernels/attention.py
run() {  # tag tree config
  local tag=$1 tree=$2 cfg=$3
  echo "=== $tag start at ${SECONDS}s"
  ( cd "$tree" && . tools/device/env.sh && python3 -m s4kv.runtime.cli bench --out /tmp/b-$tag --configs "$cfg" \
      --workloads short --budget-s 170 2>&1 | grep -v "^INFO\|^(EngineCore" | tail -15 )
  cp /tmp/b-$tag/results.json "$OUT/$tag.json" 2>/dev/null
}
run 1_k3 "$PWD" s4kv_kivi
run 2_k5 /tmp/k5 s4kv_kivi
run 3_bf16 "$PWD" bf16_fa3
[ $SECONDS -lt 360 ] && run 4_k5 /tmp/k5 s4kv_kivi
[ $SECONDS -lt 470 ] && run 5_k3 "$PWD" s4kv_kivi
echo "done at ${SECONDS}s"
tar -czf "$OUT/logs.tgz" -C /tmp b-1_k3/logs b-2_k5/logs b-3_bf16/logs b-4_k5/logs b-5_k3/logs 2>/dev/null
