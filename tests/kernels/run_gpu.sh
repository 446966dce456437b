#!/usr/bin/env bash
# Every kernel test on the lent GPU in one call: the reference tests, the store/attention tests (compiled
# kernels on CUDA, not the interpreter) and the `gpu` tests at real sizes, which print the relative-error
# table. Bounded to 9 minutes (run it with the device's timeout_s=600). From the repository root on the GPU machine:
#     bash tests/kernels/run_gpu.sh              # everything in tests/kernels
#     bash tests/kernels/run_gpu.sh -m gpu       # extra pytest arguments select a part (here: real sizes only)
# Writes $OUT/kernel_tests.log, $OUT/kernel_tests.xml (JUnit) and $OUT/kernel_errors.md (the table).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/s4kv-kernel-tests}
export OUT
mkdir -p "$OUT"
if ! python3 -c "import s4kv.kernels" 2>/dev/null; then
  S4KV_NEEDS_VLLM=0 . tools/device/env.sh  # not installed there: the s4kv import shim
fi
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
timeout 540 python -m pytest tests/kernels -s -q -p no:cacheprovider --durations=10 \
  --junitxml="$OUT/kernel_tests.xml" "$@" 2>&1 | tee "$OUT/kernel_tests.log" | tail -n 60
