#!/usr/bin/env bash
# `s4kv eval` of every KV format on the committed reference models, with vLLM 0.26.0 on the lent H200.
#
# Once, here (the offline vLLM bundle, about 52 MB, git-ignored):
#   mkdir -p .vlb && cp /work/shared/devicekit/{vllm026-*.tar.xz,*.sh,*.py,SHA256SUMS} .vlb/
# Then: device run, carry [".vlb"], timeout_s 600:   bash tools/device_eval.sh
# (a warm machine that already has /tmp/site/vllm needs no carry). About 6-7 minutes: the bundle install
# (~60 s) and five vLLM engines per model (eager mode, ~30 s each). MODELS="models/x models/y" overrides
# the model list; EVAL_ARGS adds `s4kv eval` options. Comes back in $OUT: <model>-vllm.json/.png/.log.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?OUT must be set (the device call sets it)}"
MODELS=${MODELS:-"models/s4kv-ref-qwen2 models/s4kv-ref-llama3"}
for m in $MODELS; do [ -f "$m/config.json" ] || { echo "no $m/config.json: train and commit the models first"; exit 2; }; done
VLLM_SITE=${VLLM_SITE:-/tmp/site}  # where the bundle installs vLLM (install_vllm_bundle.sh's DEST)
if [ ! -f "$VLLM_SITE/vllm/__init__.py" ]; then
  [ -f .vlb/vllm026-base.tar.xz ] || { echo "vLLM is not installed there and .vlb was not carried"; exit 2; }
  DEST=$VLLM_SITE PREFLIGHT=0 bash .vlb/install_vllm_bundle.sh .vlb >/tmp/vlb.log 2>&1 || { tail -40 /tmp/vlb.log; exit 1; }
fi
# s4kv is not pip-installed there: expose runtime/ and kernels/ under their namespaced names, plus a
# dist-info whose entry point lets every vLLM process load the plugin (vllm.general_plugins).
site=$(mktemp -d /tmp/s4kv-eval-site.XXXXXX)
mkdir -p "$site/s4kv" "$site/s4kv-0.1.0.dist-info"
ln -sfn "$PWD/runtime" "$site/s4kv/runtime" && ln -sfn "$PWD/kernels" "$site/s4kv/kernels"
printf 'Metadata-Version: 2.1\nName: s4kv\nVersion: 0.1.0\n' >"$site/s4kv-0.1.0.dist-info/METADATA"
printf '[vllm.general_plugins]\ns4kv = s4kv.runtime.plugin:register\n' >"$site/s4kv-0.1.0.dist-info/entry_points.txt"
export PYTHONPATH=$VLLM_SITE:$site VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
  PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
status=0
for m in $MODELS; do
  name=$(basename "$m")
  echo "=== $name ($(date +%T))"
  # shellcheck disable=SC2086
  python3 -m s4kv.runtime.cli eval "$m" --out-dir "$OUT" --enforce-eager ${EVAL_ARGS:-} >"$OUT/$name-vllm.log" 2>&1 \
    || { status=1; echo "FAILED (a format or the run), end of $OUT/$name-vllm.log:"; tail -30 "$OUT/$name-vllm.log"; }
  [ -f "$OUT/$name-vllm.json" ] && python3 -m s4kv.runtime.eval_report "$OUT/$name-vllm.json"
done
exit $status
