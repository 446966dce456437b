#!/usr/bin/env bash
# GPU tests of the current DECODE_LAUNCH at real sizes (bounded)
cd "$(dirname "$0")/.."
date -u; nvidia-smi --query-gpu=name,memory.free --format=csv,noheader
. tools/device/env.sh
timeout 200 python3 -m pytest \
  "tests/kernels/test_gpu_kernels.py::test_store_and_attention_at_real_sizes" \
  "tests/kernels/test_gpu_kernels.py::test_cuda_graph_replay_of_store_and_attention_matches_eager" \
  "tests/kernels/test_attention_kernel.py::test_joint_row_sums_match_the_reference" \
  tests/kernels/test_own_block_gpu.py \
  -rA -q -p no:cacheprovider --durations=5 > "$OUT/gputests.log" 2>&1
echo "tests exit $? (124 = hit the bound)"
grep -cE "^PASSED" "$OUT/gputests.log"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gputests.log" | tail -20
date -u
