#!/usr/bin/env bash
# GPU run of the vLLM plugin: installs the offline vLLM 0.26.0 bundle once per machine (from .vlb/, see
# shared/devicekit/README.md), makes this checkout importable as s4kv with its vllm.general_plugins entry point
# (no pip: the GPU machine is offline), then runs tools/device/plugin_e2e.py. Results: $OUT/device_plugin_e2e.json
# and every phase's log in $OUT/device_plugin_e2e_logs.tar.gz. Whole run < 9.5 minutes (the Python part stops itself after BUDGET_S seconds).
set -euo pipefail
cd "$(dirname "$0")/../.."
. tools/device/env.sh  # vLLM from .vlb once per machine, the s4kv import shim, the environment
OUT=${OUT:-/tmp/s4kv_e2e}
work=/tmp/s4kv_e2e_run  # ~20 logs: they come back as one tarball next to the summary JSON
rm -rf "$work" && mkdir -p "$OUT" "$work"
# 560 s for everything, install included (the device call allows 600): the Python part plans its phases within what is left
LEFT=$((560 - SECONDS))
status=0
timeout "$LEFT" python3 tools/device/plugin_e2e.py --out "$work" --budget-s "$((LEFT - 30))" "$@" || status=$?
[ -f "$work/device_plugin_e2e.json" ] && cp "$work/device_plugin_e2e.json" "$OUT/"
tar -czf "$OUT/device_plugin_e2e_logs.tar.gz" -C "$work" --exclude='qwen2.5-7b-shape' .
exit $status
