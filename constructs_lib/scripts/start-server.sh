#!/bin/bash
# Starts the S4 KV server (systemd unit s4kv.service runs this as user s4kv).
# The API key is read from Secrets Manager into VLLM_API_KEY, which `s4kv serve` reads from the environment: it is
# never in argv (so not in `ps`), never in a file, never printed. Every route except GET /health needs the key.
set -euo pipefail
S4KV_HOME="${S4KV_HOME:-/opt/s4kv}"
# shellcheck source=/dev/null
. "${S4KV_ENV_FILE:-/etc/s4kv/server.env}"

VLLM_API_KEY="$(aws secretsmanager get-secret-value --region "$AWS_REGION" \
  --secret-id "$S4KV_API_KEY_SECRET_ARN" --query SecretString --output text)"
export VLLM_API_KEY
export HF_HOME="$S4KV_HOME/hf"
# A gated model's Hugging Face token, the same way as the key: Secrets Manager -> environment only.
if [ -n "${S4KV_HF_TOKEN_SECRET_ARN:-}" ]; then
  HF_TOKEN="$(aws secretsmanager get-secret-value --region "$AWS_REGION" \
    --secret-id "$S4KV_HF_TOKEN_SECRET_ARN" --query SecretString --output text)"
  export HF_TOKEN
fi

# Word splitting of the settings is intended: they are separate vLLM flags. bf16 runs through the same server.
# shellcheck disable=SC2086
exec "$S4KV_HOME/venv/bin/s4kv" serve "$S4KV_MODEL" --scheme "$S4KV_SCHEME" --port "$S4KV_PORT" $S4KV_VLLM_ARGS $S4KV_EXTRA_ARGS
