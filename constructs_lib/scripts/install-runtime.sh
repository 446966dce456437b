# --- install the S4 KV runtime into /opt/s4kv from the artifact bucket (the AMI bakery runs this too) ---
# The wheel and the lock come from S3 and must match their SHA-256; pip then installs exactly the lock's
# packages, each checked against its hash, and the wheel: nothing is resolved, nothing comes from an index by name.
home="$S4KV_ROOT/opt/s4kv"
if [ ! -x "$home/venv/bin/s4kv" ]; then
  S4KV_REASON="creating the s4kv user and folders"
  id s4kv >/dev/null 2>&1 || useradd --system --home-dir /opt/s4kv --shell /usr/sbin/nologin s4kv
  install -d "$home" "$home/bin" "$home/artifacts" "$home/hf" "$S4KV_ROOT/var/log/s4kv"
  chown s4kv:s4kv "$home" "$home/hf" "$S4KV_ROOT/var/log/s4kv"  # $home is its HOME: vLLM and triton caches
  fetch() {  # key, file
    aws s3api get-object --region "$AWS_REGION" --bucket "$S4KV_ARTIFACT_BUCKET" --key "$1" "$2" >/dev/null \
      || s4kv_fail "cannot read s3://$S4KV_ARTIFACT_BUCKET/$1"
  }
  lock="$home/artifacts/runtime-lock.txt"
  wheel="$home/artifacts/$S4KV_WHEEL_NAME"
  fetch "$S4KV_LOCK_KEY" "$lock"
  fetch "$S4KV_WHEEL_KEY" "$wheel"
  echo "$S4KV_LOCK_SHA256  $lock" | sha256sum --check --quiet || s4kv_fail "lock sha256 mismatch"
  echo "$S4KV_WHEEL_SHA256  $wheel" | sha256sum --check --quiet || s4kv_fail "wheel sha256 mismatch"
  printf 's4kv @ file://%s --hash=sha256:%s\n' "$wheel" "$S4KV_WHEEL_SHA256" > "$home/artifacts/wheel-requirement.txt"
  S4KV_REASON="creating the Python environment"
  python3 -c "import ensurepip" 2>/dev/null || { apt-get update -q && apt-get install -y -q python3-venv; }
  python3 -m venv "$home/venv"
  S4KV_REASON="pip install of the lock and the wheel failed"
  "$home/venv/bin/pip" install --quiet --disable-pip-version-check --require-hashes --no-deps \
    -r "$lock" -r "$home/artifacts/wheel-requirement.txt"
  "$home/venv/bin/python" -c "import vllm, s4kv.runtime" || s4kv_fail "the runtime does not import (vllm, s4kv)"
fi
