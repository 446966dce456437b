#!/usr/bin/env bash
# Train both reference models on the lent H200 in one call (about 7.5 minutes), from the repo root:
#
#   device run, carry [".corpus"], timeout_s 600:   bash tools/device/train.sh
#
# Needs .corpus/ from `python tools/reference_models/build_corpus.py` (git-ignored; about 30 MB, so do not carry .vlb too).
# The machine's own torch 2.11 + transformers 5.17 + tokenizers are used; no vLLM, no install.
# SECONDS_PER_MODEL (default 190) sets the budget; TRAIN_ARGS adds train_reference.py options.
# Comes back in $OUT: s4kv-ref-qwen2.tar, s4kv-ref-llama3.tar, train_log.txt. Then, here:
#   for t in <files_at>/*.tar; do tar -xf "$t" -C models/; done
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?OUT must be set (the device call sets it)}"
[ -f .corpus/train.txt.xz ] || { echo "no .corpus/train.txt.xz: build it and name .corpus in carry"; exit 2; }
S4KV_NEEDS_VLLM=0 . tools/device/env.sh  # the s4kv import shim only (no vLLM needed)
export TOKENIZERS_PARALLELISM=true
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
# shellcheck disable=SC2086  # TRAIN_ARGS is a list of options
python3 tools/reference_models/train_reference.py --out "$OUT" --seconds-per-model "${SECONDS_PER_MODEL:-190}" ${TRAIN_ARGS:-}
ls -la "$OUT"
