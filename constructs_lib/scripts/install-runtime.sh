# --- install the S4 KV runtime into /opt/s4kv (idempotent; the baked AMI runs this at build time) ---
# Needs VLLM_PIP_SPEC and S4KV_PIP_SPEC. Writes start-server and s4kv.service (not enabled: boot does that).
if [ ! -x /opt/s4kv/venv/bin/s4kv ]; then
  id s4kv >/dev/null 2>&1 || useradd --system --home-dir /opt/s4kv --shell /usr/sbin/nologin s4kv
  install -d -o s4kv -g s4kv /opt/s4kv /opt/s4kv/hf /var/log/s4kv
  install -d /opt/s4kv/bin /etc/s4kv
  python3 -c "import ensurepip" 2>/dev/null || { apt-get update -q && apt-get install -y -q python3-venv; }
  python3 -m venv /opt/s4kv/venv
  /opt/s4kv/venv/bin/pip install -q --upgrade pip
  /opt/s4kv/venv/bin/pip install -q "$VLLM_PIP_SPEC" "$S4KV_PIP_SPEC"
fi
if [ ! -x /opt/aws/amazon-cloudwatch-agent/bin/amazon-cloudwatch-agent-ctl ]; then
  curl -fsSL -o /tmp/amazon-cloudwatch-agent.deb \
    https://s3.amazonaws.com/amazoncloudwatch-agent/ubuntu/amd64/latest/amazon-cloudwatch-agent.deb
  dpkg -i -E /tmp/amazon-cloudwatch-agent.deb
fi
