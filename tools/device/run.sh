#!/usr/bin/env bash
# The GPU-machine runner: one entry point for every job run on a lent GPU machine, from the repository root.
#
#   bash tools/device/run.sh COMMAND [ARGS...]
#
# COMMAND        what it runs                                                        needs carried
#   kernel-tests  the GPU kernel tests at real sizes (tests/kernels/run_gpu.sh)        -
#   smoke         a quick correctness and timing pass of the kernels (gpu_smoke.py)    -
#   bench ...     kernel benchmarks, the launch sweep, `s4kv bench` (bench.sh; ARGS: tune, kernels, e2e [s4kv bench
#                 options])                                                          .vlb for e2e
#   eval          `s4kv eval` of every KV format on the bundled reference models      .vlb
#   plugin-e2e    the plugin under vLLM: capacity, the engine matrix, the OpenAI server  .vlb
#   parallel ...  tensor / data parallel benchmarks and servers on N >= 2 GPUs        .vlb
#   train         the reference models from .corpus/                                  .corpus
#   final         kernel tests, both servers, the end-to-end benchmark, each bounded   .vlb
#   pair JOB0 JOB1  two jobs side by side, one per GPU of a 2-GPU machine             what the jobs need
#
# .vlb is the offline vLLM 0.26.0 bundle (tools/device/env.sh installs it once per machine); each job writes its
# results under $OUT. The header of each job's script says what it measures, how long it takes and what comes back.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
[ $# -ge 1 ] || { usage >&2; exit 2; }
command=$1
shift
case "$command" in
  kernel-tests) exec bash "$here/../../tests/kernels/run_gpu.sh" "$@" ;;
  smoke) cd "$here/../.."; S4KV_NEEDS_VLLM=0 . tools/device/env.sh; exec python3 tools/device/gpu_smoke.py "$@" ;;
  bench) exec bash "$here/bench.sh" "$@" ;;
  eval) exec bash "$here/eval.sh" "$@" ;;
  plugin-e2e) exec bash "$here/plugin_e2e.sh" "$@" ;;
  parallel) exec bash "$here/parallel.sh" "$@" ;;
  train) exec bash "$here/train.sh" "$@" ;;
  final) exec bash "$here/final.sh" "$@" ;;
  pair) exec bash "$here/pair.sh" "$@" ;;
  -h|--help|help) usage; exit 0 ;;
  *) echo "tools/device/run.sh: unknown command '$command'" >&2; usage >&2; exit 2 ;;
esac
