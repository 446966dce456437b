# --- readiness signal: CloudFormation learns the outcome of this boot (the instance's CreationPolicy) ---
# Every exit signals: FAILURE with the reason (s4kv_fail sets it; the log has the details), or SUCCESS from the
# end of boot.sh. SignalResource has no reason field: the reason rides in the signal's unique id, which the
# stack event shows ("Received FAILURE signal with UniqueId i-0123...: wheel sha256 mismatch").
S4KV_REASON="the boot script stopped"
s4kv_fail() {
  S4KV_REASON="$1"
  echo "s4kv: FAILED: $1" >&2
  exit 1
}
s4kv_signal() {  # SUCCESS|FAILURE [reason]
  local unique
  unique="$(cat "$S4KV_ROOT/var/lib/cloud/data/instance-id")${2:+: $2}"
  aws cloudformation signal-resource --region "$AWS_REGION" --stack-name "$S4KV_STACK_NAME" \
    --logical-resource-id "$S4KV_SIGNAL_RESOURCE" --unique-id "${unique:0:64}" --status "$1"
}
s4kv_on_exit() {
  local status=$?
  if [ "$status" -ne 0 ]; then
    echo "s4kv: boot failed (exit $status): $S4KV_REASON" >&2
    s4kv_signal FAILURE "$S4KV_REASON" || echo "s4kv: could not signal CloudFormation" >&2
  fi
}
trap s4kv_on_exit EXIT
