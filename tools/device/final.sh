#!/usr/bin/env bash
# One H200 call that checks as much as a short device budget allows, in order of value, each part bounded:
# GPU kernel tests at real sizes, both schemes behind vLLM's OpenAI server (openai client), then the end-to-end
# benchmark (bf16 + FA3 against both schemes, short and long workloads, same run). Everything lands in $OUT.
# device run, carry [".vlb"], timeout_s 600:  bash tools/device/final.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?OUT must be set (the device call sets it)}"
R=/tmp/r && rm -rf $R && mkdir -p $R
if [ ! -f /tmp/site/vllm/__init__.py ]; then
  PREFLIGHT=0 bash .vlb/install_vllm_bundle.sh .vlb >/tmp/vlb.log 2>&1 || { tail -20 /tmp/vlb.log; exit 1; }
fi
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 \
  VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
# KERNEL_TEST_S bounds the kernel tests; KERNEL_TEST_ARGS selects them (pytest arguments)
echo "== kernel tests (${KERNEL_TEST_ARGS:=-m gpu -k real_sizes}) at ${SECONDS}s"
# shellcheck disable=SC2086
OUT=$R timeout "${KERNEL_TEST_S:-70}" bash tests/kernels/run_gpu.sh -q $KERNEL_TEST_ARGS > $R/kernel_tests_console.log 2>&1
tail -4 $R/kernel_tests_console.log
echo "== OpenAI servers at ${SECONDS}s"
timeout 110 python3 tools/device/plugin_e2e.py server --out $R --scheme int4_kivi --model "$PWD/models/tiny-qwen2" \
  > $R/server_kivi.out 2>&1 &
timeout 110 python3 tools/device/plugin_e2e.py server --out $R --scheme int4_saw --model "$PWD/models/tiny-llama3" \
  --raw > $R/server_saw.out 2>&1
wait
grep -h RESULT $R/server_*.out || tail -5 $R/server_*.out
echo "== end-to-end benchmark at ${SECONDS}s"
# BENCH_WORKLOADS: the end-to-end workloads (default short,long)
OUT=$R LIMIT_S=$((585 - SECONDS)) bash tools/device/bench.sh e2e --configs bf16_fa3,s4kv_saw,s4kv_kivi \
  --workloads "${BENCH_WORKLOADS:-short,long}" > $R/bench_console.log 2>&1
tail -25 $R/bench_console.log
for f in results.json table.md plot.svg kernel_errors.md kernel_tests.log; do [ -f $R/$f ] && cp $R/$f $OUT/; done
tar -czf $OUT/logs.tgz -C $R . 2>/dev/null
echo "done at ${SECONDS}s"
