#!/usr/bin/env bash
# Two device jobs side by side on a 2-GPU machine (kind nvidia-h200-x2), one per GPU, in one call:
#   bash tools/device/pair.sh 'JOB FOR GPU 0' 'JOB FOR GPU 1'
# e.g. training (tools/device/train.sh) beside the kernel tests, or quality evaluation beside a benchmark: GPU
# work that does not need both GPUs at once costs half the device time. Each job is a bash command line run from
# the repository root with CUDA_VISIBLE_DEVICES set to its GPU and OUT=$OUT/gpuN; its output goes to
# $OUT/gpuN/job.log and, prefixed with [gpuN], to this script's output. The jobs share the host (32 cores): timings
# taken beside another job are labelled so wherever they are reported.
# Back in $OUT: pair.tar.gz (both jobs' folders; a device call returns at most 8 files) and pair.log.
# Exit status: 0 when both jobs succeed, else the first failing job's.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?OUT must be set (the device call sets it)}"
[ $# -eq 2 ] || { echo "usage: device_pair.sh 'JOB FOR GPU 0' 'JOB FOR GPU 1'"; exit 2; }
export PYTHONUNBUFFERED=1
pack() { [ -d "$OUT/gpu0" ] && tar -czf "$OUT/pair.tar.gz" -C "$OUT" gpu0 gpu1 && rm -rf "$OUT/gpu0" "$OUT/gpu1"; }
pids=()
# a call cut at its limit still returns one archive, not more files than come back
trap 'kill "${pids[@]}" 2>/dev/null; pack; exit 124' TERM
for gpu in 0 1; do
  job=${*:gpu+1:1}
  mkdir -p "$OUT/gpu$gpu"
  echo "[gpu$gpu] $job"
  ( CUDA_VISIBLE_DEVICES=$gpu OUT="$OUT/gpu$gpu" bash -c "$job" 2>&1 | tee "$OUT/gpu$gpu/job.log" \
      | sed -u "s/^/[gpu$gpu] /" ) &
  pids+=($!)
done
status=0
for gpu in 0 1; do
  wait "${pids[$gpu]}"
  rc=$?
  echo "[gpu$gpu] exit status $rc after ${SECONDS} s" | tee -a "$OUT/pair.log"
  [ "$status" -ne 0 ] || status=$rc
done
pack
exit "$status"
