#!/usr/bin/env bash
# The benchmarks of issues 2 and 4 on the lent H200, with vLLM 0.26.0 from the offline bundle.
#
# Once, here (the bundle, about 52 MB, git-ignored):
#   echo /.vlb/ >> .git/info/exclude
#   mkdir -p .vlb && cp /work/shared/devicekit/{vllm026-*.tar.xz,*.sh,*.py,SHA256SUMS} .vlb/
# Then one device run per line, carry [".vlb"] (a warm machine that has /tmp/site/vllm needs none), timeout_s 600:
#   bash tools/device_bench.sh kernels                       # decode + store kernels, about 3 minutes
#   bash tools/device_bench.sh e2e --configs bf16_fa3,s4kv_kivi,s4kv_saw --workloads short,long
#   bash tools/device_bench.sh e2e --configs bf16_fa3,s4kv_kivi,s4kv_saw --workloads 24gb
#   bash tools/device_bench.sh e2e --configs bf16_fa3,s4kv_kivi,s4kv_saw --workloads many
# (docs/performance.md has the split of every configuration into 10-minute calls). Anything after `e2e` goes
# to `s4kv bench`. The e2e runs stop starting engines that would not finish inside LIMIT_S (default 570) of
# this script's start. Back in $OUT: kernels.json/.md, or results.json, table.md, plot.svg and
# e2e-logs.tar.gz (every engine's log). Merge the results.json of several calls here with
#   s4kv bench --merge call1/results.json call2/results.json --out docs/bench
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?OUT must be set (the device call sets it)}"
mode=${1:?usage: device_bench.sh kernels | e2e [s4kv bench options]}
shift
limit=${LIMIT_S:-570}

if [ ! -f /tmp/site/vllm/__init__.py ]; then
  [ -f .vlb/vllm026-base.tar.xz ] || { echo "vLLM is not installed there and .vlb was not carried"; exit 2; }
  PREFLIGHT=0 bash .vlb/install_vllm_bundle.sh .vlb >/tmp/vlb.log 2>&1 || { tail -40 /tmp/vlb.log; exit 1; }
fi
# s4kv is not pip-installed there: expose runtime/ and kernels/ under their namespaced names, plus a
# dist-info whose entry point lets every vLLM process load the plugin (vllm.general_plugins).
site=/tmp/s4kv-path
mkdir -p "$site/s4kv" "$site/s4kv-0.1.0.dist-info"
ln -sfn "$PWD/runtime" "$site/s4kv/runtime" && ln -sfn "$PWD/kernels" "$site/s4kv/kernels"
printf 'Metadata-Version: 2.1\nName: s4kv\nVersion: 0.1.0\n' >"$site/s4kv-0.1.0.dist-info/METADATA"
printf '[vllm.general_plugins]\ns4kv = s4kv.runtime.plugin:register\n' >"$site/s4kv-0.1.0.dist-info/entry_points.txt"
export PYTHONPATH=/tmp/site:$site VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
  PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv,noheader || true

case "$mode" in
  kernels)
    budget=$((limit - SECONDS - 90))  # decode configs; the store timings and the report come after
    [ "$budget" -gt 300 ] && budget=300
    python3 tools/bench_kernels.py --out "$OUT" --budget-s "$budget" 2>&1 | tee "$OUT/kernels.log"
    ;;
  e2e)
    work=/tmp/s4kv-bench
    rm -rf "$work"
    status=0
    python3 -m s4kv.runtime.cli bench --out "$work" --budget-s $((limit - SECONDS)) "$@" || status=$?
    for f in results.json table.md plot.svg; do [ -f "$work/$f" ] && cp "$work/$f" "$OUT/"; done
    [ -d "$work/logs" ] && tar -czf "$OUT/e2e-logs.tar.gz" -C "$work" logs
    exit $status
    ;;
  *)
    echo "unknown mode $mode: use kernels or e2e"; exit 2 ;;
esac
