#!/usr/bin/env bash
# GPU run of the vLLM plugin (issue 3): installs the offline vLLM 0.26.0 bundle once per machine (from .vlb/, see
# shared/devicekit/README.md), makes this checkout importable as s4kv with its vllm.general_plugins entry point
# (no pip: the GPU machine is offline), then runs tools/device_plugin_e2e.py. Results: $OUT/device_plugin_e2e.json
# and every phase's log in $OUT/device_plugin_e2e_logs.tar.gz. Whole run < 9.5 minutes (the Python part stops itself after BUDGET_S seconds).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -f /tmp/site/vllm/__init__.py ]; then
  [ -d .vlb ] || { echo "no .vlb/: copy shared/devicekit's bundle there and carry it (shared/devicekit/README.md)"; exit 2; }
  PREFLIGHT=0 bash .vlb/install_vllm_bundle.sh .vlb >/tmp/vlb.log 2>&1 || { tail -40 /tmp/vlb.log; exit 1; }
fi
# s4kv as installed: s4kv.runtime -> runtime/, s4kv.kernels -> kernels/, and a dist-info declaring the entry point
SITE=/tmp/s4kv_site
rm -rf "$SITE" && mkdir -p "$SITE/s4kv" "$SITE/s4kv-0.1.0.dist-info"
ln -s "$PWD/runtime" "$SITE/s4kv/runtime"
ln -s "$PWD/kernels" "$SITE/s4kv/kernels"
printf 'Metadata-Version: 2.1\nName: s4kv\nVersion: 0.1.0\n' >"$SITE/s4kv-0.1.0.dist-info/METADATA"
printf '[vllm.general_plugins]\ns4kv = s4kv.runtime.plugin:register\n' >"$SITE/s4kv-0.1.0.dist-info/entry_points.txt"
export PYTHONPATH="/tmp/site:$SITE" VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
PY=${VLLM_PYTHON:-/opt/torch/.venv/bin/python3}
[ -x "$PY" ] || PY=python3
OUT=${OUT:-/tmp/s4kv_e2e}
work=/tmp/s4kv_e2e_run  # ~20 logs: they come back as one tarball next to the summary JSON
rm -rf "$work" && mkdir -p "$OUT" "$work"
# 560 s for everything, install included (the device call allows 600): the Python part plans its phases within what is left
LEFT=$((560 - SECONDS))
status=0
timeout "$LEFT" "$PY" tools/device_plugin_e2e.py --out "$work" --budget-s "$((LEFT - 30))" "$@" || status=$?
[ -f "$work/device_plugin_e2e.json" ] && cp "$work/device_plugin_e2e.json" "$OUT/"
tar -czf "$OUT/device_plugin_e2e_logs.tar.gz" -C "$work" --exclude='qwen2.5-7b-shape' .
exit $status
