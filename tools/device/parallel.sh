#!/usr/bin/env bash
# Tensor and data parallel benchmarks and servers on a machine of N >= 2 GPUs (kind nvidia-h200-x2 today; -x4 / -x8 when lent), vLLM 0.26.0 from the offline
# bundle, in one device call. N is every GPU the machine has (nvidia-smi -L; DRY_RUN uses GPUS, default 2):
#   tp  Llama-3.1-70B-Instruct shape (configs/llama-3.1-70b-instruct.json, dummy weights, 141 GB split over N GPUs),
#       tensor parallel N, workload short128 (128 x 1024 in / 128 out), one engine over all GPUs
#   dp  Qwen2.5-7B-Instruct shape, data parallel N: one engine per GPU, each with 1/N of workload short
#       (256 x 1024 in / 256 out), throughput summed (what `vllm serve --data-parallel-size N` runs for a dense model)
# each for s4kv int4_kivi, bf16 + FA3 and s4kv int4_saw, in that order, through `s4kv bench` (docs/parallel.md).
#   serve  the OpenAI server under both layouts, side by side, each checked with the official openai client
#       (tools/device/plugin_e2e.py's server checks): `s4kv serve --tensor-parallel-size N` (int4_kivi, tiny Qwen2)
#       and raw `vllm serve --data-parallel-size N --attention-backend CUSTOM` (int4_saw, tiny Llama-3); ~3 minutes.
#
# Once, here (the bundle, about 52 MB, git-ignored; the same as for tools/device/bench.sh):
#   echo /.vlb/ >> .git/info/exclude
#   mkdir -p .vlb && cp /work/shared/devicekit/{vllm026-*.tar.xz,*.sh,*.py,SHA256SUMS} .vlb/
# Then one device call, kind nvidia-h200-x2, carry [".vlb"], timeout_s 600:
#   bash tools/device/parallel.sh                 # = tp dp: both layouts, every configuration that fits
#   bash tools/device/parallel.sh serve dp tp=s4kv_saw  # a later call: the servers, then what the first skipped
# A step is `serve`, or `tp` or `dp` optionally with `=CONFIGS` (a comma list for `s4kv bench --configs`, started
# in that order).
# Everything shares LIMIT_S (default 570 s) from this script's start, the bundle's install included: each step's
# `s4kv bench --budget-s` gets what is left, and an engine that would not fit is recorded as `skipped` with the
# reason. Back in $OUT (up to 6 files): results.json, table.md, plot.svg (all steps merged), logs.tar.gz (every
# engine's and server's log), serve.json (the server checks) and parallel.log (this script's output). DRY_RUN=1 prints the plans and stops (no GPU).
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?OUT must be set (the device call sets it)}"
limit=${LIMIT_S:-570}
PY=${PYTHON:-python3}
DEFAULT_CONFIGS=s4kv_kivi,bf16_fa3,s4kv_saw
RESERVE_S=15  # merge, tarball

steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(tp dp)
for step in "${steps[@]}"; do
  [[ "$step" =~ ^((tp|dp)(=[a-z0-9_,]+)?|serve)$ ]] \
    || { echo "usage: device_parallel.sh [tp[=CONFIGS]] [dp[=CONFIGS]] [serve] ..."; exit 2; }
done

# NVLink multicast stays off on the shared host (KINDS.md): NCCL, PyTorch and NVSHMEM, and vLLM's symmetric-memory
# all-reduce, which would rendezvous multicast buffers; all-reduces go through vLLM's custom all-reduce or NCCL.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_ALLREDUCE_USE_SYMM_MEM=0

log="$OUT/parallel.log"
say() { echo "$*" | tee -a "$log"; }
: >"$log"

if [ "${DRY_RUN:-0}" = 1 ]; then
  gpus=${GPUS:-2}
  S4KV_NEEDS_VLLM=0 . tools/device/env.sh  # the s4kv import shim only: plans need no vLLM and no GPU
else
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  [ "${gpus:-0}" -ge 2 ] || { say "needs 2 or more GPUs, found ${gpus:-0}: run it on kind nvidia-h200-x2"; exit 2; }
  . tools/device/env.sh  # vLLM from .vlb once per machine, the s4kv import shim (every worker loads the plugin)
  say "[parallel] vLLM ready after ${SECONDS} s"
  { nvidia-smi --query-gpu=index,name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv,noheader
    nvidia-smi topo -m; } 2>&1 | tee -a "$log" || true
fi

TP_ARGS=(--model configs/llama-3.1-70b-instruct.json --tensor-parallel-size "$gpus" --workloads short128)
DP_ARGS=(--model configs/qwen2.5-7b-instruct.json --data-parallel-size "$gpus" --workloads short)
say "[parallel] $gpus GPUs: tensor parallel $gpus, data parallel $gpus"

work=${WORK_DIR:-/tmp/s4kv-parallel}
rm -rf "$work" && mkdir -p "$work"
status=0

# The serve step: two servers side by side (tiny models, 0.08 of each GPU), each through the openai client checks
# of tools/device/plugin_e2e.py (chat, completions, streaming, n=3, stop, max_tokens, HTTP 400, concurrency, /health).
SERVERS=("tp$gpus int4_kivi models/tiny-qwen2 s4kv --tensor-parallel-size $gpus"
         "dp$gpus int4_saw models/tiny-llama3 raw --data-parallel-size $gpus")
SERVE_MIN_S=180  # start (~60-100 s each, side by side) plus the client checks, with a margin
serve_step() {  # $1: seconds left
  local dir="$work/serve" name scheme model how flags pids=()
  mkdir -p "$dir/logs"
  for server in "${SERVERS[@]}"; do
    read -r name scheme model how flags <<<"$server"
    local cmd=("$PY" tools/device/plugin_e2e.py server --out "$dir/logs" --scheme "$scheme" --model "$PWD/$model"
               --timeout-s "$(($1 - 60))" "--vllm-args=$flags")
    [ "$how" = raw ] && cmd+=(--raw)
    say "[serve] $name: ${cmd[*]}"
    [ "${DRY_RUN:-0}" = 1 ] && continue
    timeout "$1" "${cmd[@]}" >"$dir/logs/$name.log" 2>&1 &
    pids+=($!)
  done
  [ "${DRY_RUN:-0}" = 1 ] && return 0
  for pid in "${pids[@]}"; do wait "$pid" || true; done
  "$PY" - "$dir" "$OUT/serve.json" <<'PYEOF' 2>&1 | tee -a "$log"
import json, sys
from pathlib import Path
checks = ("chat", "completion", "stream", "n=3", "stop", "max_tokens", "too_long_400", "concurrent", "health")
results, failed = {}, 0
for path in sorted(Path(sys.argv[1], "logs").glob("*.log")):
    if path.name.startswith("server_"):
        continue  # the servers' own logs
    lines = [line for line in path.read_text().splitlines() if line.startswith("RESULT ")]
    result = json.loads(lines[-1][7:]) if lines else {"error": "no result: see " + path.name}
    results[path.stem] = result
    bad = [c for c in checks if result.get(c) is not True]
    failed += bool(bad)
    print(f"[serve] {path.stem}: " + ("all checks passed" if not bad else "FAILED " + ", ".join(bad))
          + f"; started in {result.get('startup_s')} s; GPU KV cache size {result.get('kv_line')} tokens")
Path(sys.argv[2]).write_text(json.dumps(results, indent=1))
sys.exit(1 if failed or not results else 0)
PYEOF
  return "${PIPESTATUS[0]}"
}
i=0
for step in "${steps[@]}"; do
  i=$((i + 1))
  kind=${step%%=*}
  if [ "$kind" = serve ]; then
    left=$((limit - SECONDS - RESERVE_S))
    if [ "$left" -lt "$SERVE_MIN_S" ]; then  # recorded like a bench engine that would not fit: skipped, not failed
      say "[parallel] step $i: serve skipped: ${left} s left, the two servers need ${SERVE_MIN_S} s"
      printf '{"skipped": "%s s left, the servers need %s s"}\n' "$left" "$SERVE_MIN_S" >"$OUT/serve.json"
      continue
    fi
    say "[parallel] step $i: serve, ${left} s left"
    serve_step "$left" || status=1
    continue
  fi
  configs=$DEFAULT_CONFIGS
  [ "$step" = "$kind" ] || configs=${step#*=}
  if [ "$kind" = tp ]; then args=("${TP_ARGS[@]}"); else args=("${DP_ARGS[@]}"); fi
  left=$((limit - SECONDS - RESERVE_S))
  [ "$left" -gt 0 ] || left=0
  dry=()
  [ "${DRY_RUN:-0}" = 1 ] && dry=(--dry-run)
  say "[parallel] step $i: $kind, configs $configs, ${left} s left"
  set +e
  "$PY" -m s4kv.runtime.cli bench --in-order --configs "$configs" --out "$work/step$i-$kind" --budget-s "$left" \
    "${args[@]}" "${dry[@]}" 2>&1 | tee -a "$log"
  code=${PIPESTATUS[0]}
  set -e
  [ "$code" = 0 ] || status=$code
done
[ "${DRY_RUN:-0}" = 1 ] && exit $status

shopt -s nullglob
results=("$work"/step*/results.json)
if [ ${#results[@]} -gt 0 ]; then
  "$PY" -m s4kv.runtime.cli bench --merge "${results[@]}" --out "$work/all" 2>&1 | tee -a "$log" || status=1
  for f in results.json table.md plot.svg; do [ -f "$work/all/$f" ] && cp "$work/all/$f" "$OUT/"; done
fi
logs=()  # the steps that ran (a run without `serve` has no serve/logs)
for dir in "$work"/step*/logs "$work"/serve/logs; do [ -d "$dir" ] && logs+=("${dir#"$work"/}"); done
[ ${#logs[@]} -eq 0 ] || tar -czf "$OUT/logs.tar.gz" -C "$work" "${logs[@]}"
say "[parallel] done in ${SECONDS} s, exit $status"
exit $status
