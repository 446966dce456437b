#!/usr/bin/env bash
# The rest of the GPU tests at real sizes (the first 69 passed in the previous job), then the other GPU tests
cd "$(dirname "$0")/.."
date -u; nvidia-smi --query-gpu=name --format=csv,noheader
. tools/device/env.sh
mapfile -t ids < .devrun/rest_ids.txt
timeout 230 python3 -m pytest "${ids[@]}" \
  "tests/kernels/test_gpu_kernels.py::test_cuda_graph_replay_of_store_and_attention_matches_eager" \
  "tests/kernels/test_attention_kernel.py::test_joint_row_sums_match_the_reference" \
  tests/kernels/test_own_block_gpu.py \
  -rA -q -p no:cacheprovider --durations=5 > "$OUT/gputests2.log" 2>&1
echo "tests exit $? (124 = hit the bound)"
grep -cE "^PASSED" "$OUT/gputests2.log"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gputests2.log" | tail -20
date -u
