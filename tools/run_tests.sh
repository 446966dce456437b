#!/usr/bin/env bash
# The README's test command: sets up .venv if needed, lints, then runs every test that needs no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
. .venv/bin/activate
ruff check .   # the lint configuration of pyproject.toml ([tool.ruff])
exec python -m pytest -m "not gpu" -q --durations=15 "$@"   # the slowest tests: CI has 90 minutes
