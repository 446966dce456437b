# --- boot: logs to CloudWatch, then start the server (reads /etc/s4kv/server.env) ---
# shellcheck source=/dev/null
. /etc/s4kv/server.env
if [ ! -x /opt/s4kv/bin/start-server ]; then
  echo "s4kv: runtime missing in /opt/s4kv (an AMI not built by the S4 KV recipe?)" >&2
  exit 1
fi
cat > /opt/aws/amazon-cloudwatch-agent/etc/s4kv-logs.json <<CWEOF
{"logs": {"logs_collected": {"files": {"collect_list": [
  {"file_path": "/var/log/s4kv/server.log", "log_group_name": "$S4KV_LOG_GROUP", "log_stream_name": "{instance_id}/server"},
  {"file_path": "/var/log/cloud-init-output.log", "log_group_name": "$S4KV_LOG_GROUP", "log_stream_name": "{instance_id}/cloud-init"}
]}}}}
CWEOF
/opt/aws/amazon-cloudwatch-agent/bin/amazon-cloudwatch-agent-ctl -a fetch-config -m ec2 -s \
  -c file:/opt/aws/amazon-cloudwatch-agent/etc/s4kv-logs.json
systemctl daemon-reload
systemctl enable --now s4kv.service
