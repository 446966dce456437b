# --- boot: start the server, wait until it answers, signal CloudFormation ---
S4KV_REASON="the runtime is missing in /opt/s4kv (an AMI not built by the S4 KV recipe?)"
[ -x "$S4KV_ROOT/opt/s4kv/bin/start-server" ] || exit 1
S4KV_REASON="no NVIDIA GPU visible (nvidia-smi failed)"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
S4KV_REASON="starting s4kv.service"
systemctl daemon-reload
systemctl enable --now s4kv.service

S4KV_REASON="cannot read the API key from Secrets Manager"
api_key="$(aws secretsmanager get-secret-value --region "$AWS_REGION" --secret-id "$S4KV_API_KEY_SECRET_ARN" \
  --query SecretString --output text)"
# curl reads the key from its config on stdin: it never appears in a process's argv.
s4kv_call() {  # output file, path, [JSON body]; prints the HTTP status (000: no answer)
  local args=(--silent --config - --max-time 120 --output "$1" --write-out '%{http_code}')
  [ -z "${3:-}" ] || args+=(--header "Content-Type: application/json" --data "$3")
  printf 'header = "Authorization: Bearer %s"\n' "$api_key" | curl "${args[@]}" "http://127.0.0.1:$S4KV_PORT$2" || true
}
minutes="${S4KV_BOOT_TIMEOUT//[!0-9]/}"
# Give up 2 minutes before CloudFormation does, so that the stack event carries this script's reason.
deadline=$(( $(date +%s) + minutes * 60 - 120 ))
started=$(date +%s)
until [ "$(s4kv_call /dev/null /health)" = 200 ]; do
  restarts="$(systemctl show --property NRestarts --value s4kv.service)"
  [ "${restarts:-0}" -lt 3 ] || s4kv_fail "the server exited $restarts times (see the server log)"
  # s4kv serve's refusals (exit 2 bad input, 3 unsupported) stop the unit: no restart will follow.
  [ "$(systemctl show --property ActiveState --value s4kv.service)" != failed ] \
    || s4kv_fail "the server refused to start (see the server log)"
  [ "$(date +%s)" -lt "$deadline" ] || s4kv_fail "no /health 200 within $minutes minutes"
  sleep 5
done
echo "s4kv: /health is 200 after $(( $(date +%s) - started )) s"
reply="$(mktemp)"
status="$(s4kv_call "$reply" /v1/completions "{\"model\": \"$S4KV_MODEL\", \"prompt\": \"Hello\", \"max_tokens\": 4}")"
[ "$status" = 200 ] && grep -q '"choices"' "$reply" || s4kv_fail "an authenticated completion answered HTTP $status"
echo "s4kv: ready after $(( $(date +%s) - started )) s (an authenticated completion answered)"
S4KV_REASON="starting s4kv-metrics.timer"
systemctl enable --now s4kv-metrics.timer
S4KV_REASON="the SUCCESS signal could not be sent"
s4kv_signal SUCCESS
