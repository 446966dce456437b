# --- logs: the CloudWatch agent ships this boot's output and the server log to the stack's log group ---
# Started before anything is installed: cloud-init-output.log holds this script's output from its first line.
S4KV_REASON="starting the CloudWatch agent"
agent="$S4KV_ROOT/opt/aws/amazon-cloudwatch-agent"
if [ ! -x "$agent/bin/amazon-cloudwatch-agent-ctl" ]; then
  curl -fsSL -o /tmp/amazon-cloudwatch-agent.deb \
    https://s3.amazonaws.com/amazoncloudwatch-agent/ubuntu/amd64/latest/amazon-cloudwatch-agent.deb
  dpkg -i -E /tmp/amazon-cloudwatch-agent.deb
fi
install -d "$agent/etc"
cat > "$agent/etc/s4kv-logs.json" <<CWEOF
{"logs": {"logs_collected": {"files": {"collect_list": [
  {"file_path": "/var/log/cloud-init-output.log", "log_group_name": "$S4KV_LOG_GROUP", "log_stream_name": "{instance_id}/cloud-init"},
  {"file_path": "/var/log/s4kv/server.log", "log_group_name": "$S4KV_LOG_GROUP", "log_stream_name": "{instance_id}/server"}
]}}}}
CWEOF
"$agent/bin/amazon-cloudwatch-agent-ctl" -a fetch-config -m ec2 -s -c "file:$agent/etc/s4kv-logs.json"
