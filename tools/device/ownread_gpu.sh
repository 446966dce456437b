#!/usr/bin/env bash
# The read rule on the lent H200 in one call (under 8 minutes): its GPU tests (with the launch options', the CUDA-graph
# replay's and the rotation's), then decode attention timed against FA3 bf16 in the same run (the rule must cost
# no decode speed; LAUNCHES adds DECODE_LAUNCH variants), then the FlashAttention prefill (both schemes' gather + FA
# pass against FA3 bf16) at 8k and 32k. Each part is bounded and prints its bound (TEST_S, DECODE_S, PREFILL_S).
# device run, carry [".vlb"], timeout_s 600:  bash tools/device/ownread_gpu.sh
# Back in $OUT: ownread_tests.log, kernels.{json,md}, kernels.log, bench_prefill_chunked.json, prefill.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?OUT must be set (the device call sets it)}"
. tools/device/env.sh
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"

TEST_S=${TEST_S:-140}
echo "== GPU tests of the read rule, bounded to ${TEST_S}s, at ${SECONDS}s"
# the launch options' tests first (each compiles a few kernels), the decode at real sizes, then the read rule's (many
# compiles)
timeout "$TEST_S" python3 -m pytest \
  "tests/kernels/test_attention_kernel.py::test_group_as_n_matches_the_reference" \
  "tests/kernels/test_gpu_kernels.py::test_group_as_n_decode_at_real_sizes" \
  "tests/kernels/test_gpu_kernels.py::test_store_and_attention_at_real_sizes" \
  "tests/kernels/test_attention_kernel.py::test_wide_code_loads_match_the_reference" \
  "tests/kernels/test_attention_kernel.py::test_joint_row_sums_match_the_reference" \
  "tests/kernels/test_attention_kernel.py::test_unmasked_full_tiles_match_the_reference" \
  "tests/kernels/test_gpu_kernels.py::test_cuda_graph_replay_of_store_and_attention_matches_eager" \
  tests/kernels/test_own_block_gpu.py tests/kernels/test_rotation_kernel.py tests/kernels/test_own_block_attention.py \
  tests/kernels/test_own_block_prefill.py \
  -rA -q -p no:cacheprovider --durations=8 > "$OUT/ownread_tests.log" 2>&1
echo "tests exit $? (124 = hit the bound)"
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/ownread_tests.log" | tail -40

DECODE_S=${DECODE_S:-140}
# DECODE_METHODS: bench_kernels.py methods; LAUNCHES: space-separated --launch specs (NAME=SCHEME:FIELD=VALUE,...);
# DECODE_SHAPES, DECODE_CONTEXTS: bench_kernels.py --shapes, --contexts
DECODE_METHODS=${DECODE_METHODS:-fa3_bf16,s4kv_kivi,s4kv_saw}
LAUNCH_ARGS=()
for spec in ${LAUNCHES:-}; do LAUNCH_ARGS+=(--launch "$spec"); done
DECODE_CONTEXTS=${DECODE_CONTEXTS:-4096,32768}
echo "== decode attention, batch 1/32/256 x contexts $DECODE_CONTEXTS, $DECODE_METHODS ${LAUNCHES:-}, bounded to ${DECODE_S}s, at ${SECONDS}s"
timeout "$DECODE_S" python3 tools/device/bench_kernels.py --out "$OUT" --methods "$DECODE_METHODS" "${LAUNCH_ARGS[@]}" \
  --shapes "${DECODE_SHAPES:-llama-3.1-8b}" --batches 1,32,256 --contexts "$DECODE_CONTEXTS" --no-store \
  --budget-s $((DECODE_S - 30)) \
  > "$OUT/kernels.log" 2>&1
echo "decode exit $?"
tail -20 "$OUT/kernels.log"

PREFILL_S=${PREFILL_S:-110}  # 0 skips the prefill part
[ "$PREFILL_S" = 0 ] && { echo "done at ${SECONDS}s (prefill skipped)"; exit 0; }
echo "== prefill: FA3 bf16, int4_saw and int4_kivi (gather + FA), 8k and 32k prompts in 8k chunks, bounded to" \
  "${PREFILL_S}s, at ${SECONDS}s"
timeout "$PREFILL_S" python3 tools/device/bench_prefill.py --prompts 8192,32768 --chunk 8192 --no-cases > "$OUT/prefill.log" 2>&1
echo "prefill exit $?"
tail -30 "$OUT/prefill.log"
echo "done at ${SECONDS}s"
