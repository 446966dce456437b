#!/usr/bin/env bash
# The kernel, prefill, end-to-end and serving benchmarks on the lent H200, with vLLM 0.26.0 from the offline bundle.
#
# Once, here (the bundle, about 52 MB, git-ignored):
#   echo /.vlb/ >> .git/info/exclude
#   mkdir -p .vlb && cp /work/shared/devicekit/{vllm026-*.tar.xz,*.sh,*.py,SHA256SUMS} .vlb/
# Then one device run per line, carry [".vlb"] (a warm machine that has /tmp/site/vllm needs none), timeout_s 600:
#   bash tools/device/bench.sh tune                          # launch x code-path sweep of the attention kernel
#   bash tools/device/bench.sh kernels                       # decode + store kernels, about 3 minutes
#   bash tools/device/bench.sh e2e --configs bf16_fa3,s4kv_kivi,s4kv_saw --workloads short,long
#   bash tools/device/bench.sh kernels e2e --configs bf16_fa3,s4kv_saw --workloads short,long   # both in one call
#   KERNEL_ARGS="--methods fa3_bf16,s4kv_kivi,s4kv_saw" bash tools/device/bench.sh kernels prefill
#   bash tools/device/bench.sh serve --kv-cache-memory-bytes 2147483648 --rates 2,4,8 --concurrency 16,48
# (docs/performance.md: engine starts and why the full matrix needs several 10-minute calls). Anything after `e2e` goes
# to `s4kv bench`, anything after `serve` to `s4kv bench --serve` (one of the two per call); KERNEL_ARGS go to
# tools/device/bench_kernels.py; `prefill` runs tools/device/bench_prefill.py (short cases and 32k-128k chunked prompts).
# Everything shares LIMIT_S (default 570) from this script's start: the kernel benchmark
# gets at most 300 s of decode configurations, and `s4kv bench` starts no engine that would not finish in
# what is left. Back in $OUT: tune_attention.json, tune.log; kernels.json, kernels.md, kernels.log;
# bench_prefill.json, bench_prefill_chunked.json, prefill.log; results.json, table.md, plot.svg and e2e-logs.tar.gz
# (every engine's log); serve.json, serve.md, serve.svg and serve-logs.tar.gz. Merge the results.json of several calls here with
#   s4kv bench --merge job1/results.json job2/results.json --out docs/results/bench
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?OUT must be set (the device call sets it)}"
usage="usage: tools/device/bench.sh [tune] [kernels] [prefill] [e2e [s4kv bench options] | serve [s4kv bench --serve options]]"
[ $# -gt 0 ] || { echo "$usage"; exit 2; }
run_tune=0
if [ "$1" = tune ]; then run_tune=1; shift; fi
run_kernels=0
if [ "${1:-}" = kernels ]; then run_kernels=1; shift; fi
run_prefill=0
if [ "${1:-}" = prefill ]; then run_prefill=1; shift; fi
run_e2e=0 run_serve=0
if [ "${1:-}" = e2e ]; then run_e2e=1; shift; elif [ "${1:-}" = serve ]; then run_serve=1; shift; fi
[ $# -eq 0 ] || [ "$run_e2e$run_serve" != 00 ] || { echo "$usage"; exit 2; }
[ "$run_tune$run_kernels$run_prefill$run_e2e$run_serve" != 00000 ] || { echo "$usage"; exit 2; }
limit=${LIMIT_S:-570}

. tools/device/env.sh  # vLLM from .vlb once per machine, the s4kv import shim, the environment
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv,noheader || true

status=0
if [ "$run_tune" = 1 ]; then
  timeout $((limit - SECONDS - 30)) python3 tools/device/tune_attention.py 2>&1 | tee "$OUT/tune.log" || status=$?
fi
if [ "$run_kernels" = 1 ]; then
  budget=$((limit - SECONDS - 90))  # decode configs; the store timings and the report come after
  [ "$budget" -gt 300 ] && budget=300
  # shellcheck disable=SC2086  # KERNEL_ARGS is a list of options
  python3 tools/device/bench_kernels.py --out "$OUT" --budget-s "$budget" ${KERNEL_ARGS:-} 2>&1 | tee "$OUT/kernels.log" \
    || status=$?
fi
if [ "$run_prefill" = 1 ]; then
  timeout $((limit - SECONDS - 30)) python3 tools/device/bench_prefill.py 2>&1 | tee "$OUT/prefill.log" || status=$?
fi
if [ "$run_e2e" = 1 ]; then
  work=/tmp/s4kv-bench
  rm -rf "$work"
  python3 -m s4kv.runtime.cli bench --out "$work" --budget-s $((limit - SECONDS)) "$@" || status=$?
  for f in results.json table.md plot.svg; do [ -f "$work/$f" ] && cp "$work/$f" "$OUT/"; done
  [ -d "$work/logs" ] && tar -czf "$OUT/e2e-logs.tar.gz" -C "$work" logs
fi
if [ "$run_serve" = 1 ]; then
  work=/tmp/s4kv-serve
  rm -rf "$work"
  python3 -m s4kv.runtime.cli bench --serve --out "$work" --budget-s $((limit - SECONDS - 15)) "$@" || status=$?
  for f in serve.json serve.md serve.svg; do [ -f "$work/$f" ] && cp "$work/$f" "$OUT/"; done
  [ -d "$work/logs" ] && tar -czf "$OUT/serve-logs.tar.gz" -C "$work" logs
fi
exit $status
