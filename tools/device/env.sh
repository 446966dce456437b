# Sourced (not run) by the device scripts, from the repository root on the lent GPU machine:
#   . tools/device/env.sh
# 1. vLLM 0.26.0 from the offline bundle (.vlb/, carried along; shared/devicekit/README.md), installed once per
#    machine into $VLLM_SITE (default /tmp/site). S4KV_NEEDS_VLLM=0 skips it (kernel tests, training).
# 2. This checkout importable as installed (the GPU machine is offline: no pip): s4kv.runtime -> runtime/,
#    s4kv.kernels -> kernels/, plus a dist-info whose vllm.general_plugins entry point makes every vLLM process,
#    workers and API servers included, load the plugin.
# Exports PYTHONPATH and the environment every device run uses.
VLLM_SITE=${VLLM_SITE:-/tmp/site}
if [ "${S4KV_NEEDS_VLLM:-1}" = 1 ] && [ ! -f "$VLLM_SITE/vllm/__init__.py" ]; then
  [ -f .vlb/vllm026-base.tar.xz ] || { echo "vLLM is not installed there and .vlb was not carried"; exit 2; }
  DEST=$VLLM_SITE PREFLIGHT=0 bash .vlb/install_vllm_bundle.sh .vlb >/tmp/vlb.log 2>&1 \
    || { tail -40 /tmp/vlb.log; exit 1; }
fi
S4KV_SITE=$(mktemp -d /tmp/s4kv-site.XXXXXX)
mkdir -p "$S4KV_SITE/s4kv" "$S4KV_SITE/s4kv-0.1.0.dist-info"
ln -s "$PWD/runtime" "$S4KV_SITE/s4kv/runtime"
ln -s "$PWD/kernels" "$S4KV_SITE/s4kv/kernels"
printf 'Metadata-Version: 2.1\nName: s4kv\nVersion: 0.1.0\n' >"$S4KV_SITE/s4kv-0.1.0.dist-info/METADATA"
printf '[vllm.general_plugins]\ns4kv = s4kv.runtime.plugin:register\n' >"$S4KV_SITE/s4kv-0.1.0.dist-info/entry_points.txt"
export PYTHONPATH="$VLLM_SITE:$S4KV_SITE${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1
