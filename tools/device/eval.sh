#!/usr/bin/env bash
# `s4kv eval` of every KV format on the committed reference models, with vLLM 0.26.0 on the lent H200.
#
# Once, here (the offline vLLM bundle, about 52 MB, git-ignored):
#   mkdir -p .vlb && cp /work/shared/devicekit/{vllm026-*.tar.xz,*.sh,*.py,SHA256SUMS} .vlb/
# Then: device run, carry [".vlb"], timeout_s 600:   bash tools/device/eval.sh
# (a warm machine that already has /tmp/site/vllm needs no carry). About 6-7 minutes: the bundle install
# (~60 s) and five vLLM engines per model (eager mode, ~30 s each). MODELS="models/x models/y" overrides
# the model list; EVAL_ARGS adds `s4kv eval` options. Comes back in $OUT: <model>-vllm.json/.png/.log.
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?OUT must be set (the device call sets it)}"
MODELS=${MODELS:-"models/s4kv-ref-qwen2 models/s4kv-ref-llama3"}
for m in $MODELS; do [ -f "$m/config.json" ] || { echo "no $m/config.json: train and commit the models first"; exit 2; }; done
. tools/device/env.sh  # vLLM from .vlb once per machine, the s4kv import shim, the environment
export TOKENIZERS_PARALLELISM=false
status=0
for m in $MODELS; do
  name=$(basename "$m")
  echo "=== $name ($(date +%T))"
  # shellcheck disable=SC2086
  python3 -m s4kv.runtime.cli eval "$m" --out-dir "$OUT" --enforce-eager ${EVAL_ARGS:-} >"$OUT/$name-vllm.log" 2>&1 \
    || { status=1; echo "FAILED (a format or the run), end of $OUT/$name-vllm.log:"; tail -30 "$OUT/$name-vllm.log"; }
  [ -f "$OUT/$name-vllm.json" ] && python3 -m s4kv.runtime.eval.report "$OUT/$name-vllm.json"
done
exit $status
