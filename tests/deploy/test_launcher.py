"""scripts/start-server.sh, the server's launcher, run for real with stub `aws`, `s4kv` and `vllm`:
the command line it execs, and the API key only ever in the environment."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from deploy_support import REPO

LAUNCHER = REPO / "constructs_lib" / "scripts" / "start-server.sh"
KEY = "k3y-from-secrets-manager-0123456789"


def _stub(path: Path, body: str) -> None:
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)


@pytest.mark.parametrize("scheme, program", [("int4_kivi", "s4kv"), ("int4_saw", "s4kv"), ("bf16", "vllm")])
def test_launcher_execs_the_server_with_the_plan_flags_and_the_key_in_env(tmp_path, scheme, program):
    bin_dir, venv_bin = tmp_path / "bin", tmp_path / "venv" / "bin"
    bin_dir.mkdir()
    venv_bin.mkdir(parents=True)
    # aws: records its argv, answers the secret's value like `--query SecretString --output text` does.
    _stub(bin_dir / "aws", f'echo "$@" > "{tmp_path}/aws.argv"\necho "{KEY}"\n')
    for name in ("s4kv", "vllm"):
        _stub(venv_bin / name, f'printf "%s\\n" "$0" "$@" > "{tmp_path}/server.argv"\n'
                               f'echo "$VLLM_API_KEY" > "{tmp_path}/server.key"\n')
    env_file = tmp_path / "server.env"
    env_file.write_text(
        "S4KV_MODEL='Qwen/Qwen2.5-7B-Instruct'\n"
        f"S4KV_SCHEME='{scheme}'\n"
        "S4KV_VLLM_ARGS='--tensor-parallel-size 1 --data-parallel-size 4 --max-model-len 32768 "
        "--gpu-memory-utilization 0.9'\n"
        "S4KV_EXTRA_ARGS='--enable-prefix-caching'\n"
        "S4KV_API_KEY_SECRET_ARN='arn:aws:secretsmanager:us-east-1:123456789012:secret:s4kv-AbCdEf'\n"
        "S4KV_LOG_GROUP='logs'\nAWS_REGION='us-east-1'\nS4KV_PORT='8000'\n")
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "S4KV_HOME": str(tmp_path), "S4KV_ENV_FILE": str(env_file)}
    subprocess.run(["bash", str(LAUNCHER)], env=env, check=True, timeout=30)

    argv = (tmp_path / "server.argv").read_text().split("\n")[:-1]
    assert argv[0] == str(venv_bin / program)
    expected = ["serve", "Qwen/Qwen2.5-7B-Instruct"] + (["--scheme", scheme] if program == "s4kv" else []) + [
        "--port", "8000", "--tensor-parallel-size", "1", "--data-parallel-size", "4", "--max-model-len", "32768",
        "--gpu-memory-utilization", "0.9", "--enable-prefix-caching"]
    assert argv[1:] == expected
    assert KEY not in " ".join(argv) and "--api-key" not in argv, "the key must not be visible in ps"
    assert (tmp_path / "server.key").read_text().strip() == KEY  # vLLM reads VLLM_API_KEY
    assert (tmp_path / "aws.argv").read_text().split() == [
        "secretsmanager", "get-secret-value", "--region", "us-east-1", "--secret-id",
        "arn:aws:secretsmanager:us-east-1:123456789012:secret:s4kv-AbCdEf",
        "--query", "SecretString", "--output", "text"]


def test_launcher_fails_when_the_secret_cannot_be_read(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stub(bin_dir / "aws", "echo 'AccessDenied' >&2\nexit 254\n")
    env_file = tmp_path / "server.env"
    env_file.write_text("S4KV_MODEL='m'\nS4KV_SCHEME='int4_kivi'\nS4KV_VLLM_ARGS=''\nS4KV_EXTRA_ARGS=''\n"
                        "S4KV_API_KEY_SECRET_ARN='arn'\nAWS_REGION='us-east-1'\nS4KV_PORT='8000'\n")
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "S4KV_HOME": str(tmp_path), "S4KV_ENV_FILE": str(env_file)}
    result = subprocess.run(["bash", str(LAUNCHER)], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode != 0  # systemd restarts it (Restart=on-failure); no server without a key
