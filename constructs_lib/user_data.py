"""The instance's boot script, from the files in scripts/ (the AMI bakery uses the same install script).

User data, in order:
1. the root of every path (empty on an instance, see ``ROOT_LINE``);
2. an env file with the deployment's settings, the only part CloudFormation substitutes (Fn::Sub);
3. scripts/signal.sh: every exit from here on signals CloudFormation (FAILURE with the reason, or SUCCESS);
4. scripts/logs.sh: the CloudWatch agent, before anything else can fail unseen;
5. the DLAMI flavour only: scripts/install-runtime.sh (wheel + lock from S3), the launcher and the unit;
6. scripts/boot.sh: start s4kv.service, wait for /health and one authenticated completion, start the metrics
   timer (`python -m s4kv.runtime.publish_metrics`, from the wheel), signal SUCCESS.
Neither the API key nor the Hugging Face token is in it: the server reads both from Secrets Manager when it
starts (scripts/start-server.sh), and the readiness check reads the key into a shell variable only.

Every setting that changes what the server runs is in the env file, so any change of it is a new launch-template
version, which replaces the instance (stacks/serving_stack.py): cloud-init runs user data once per instance.
"""

from __future__ import annotations

from pathlib import Path

from aws_cdk import Fn

SCRIPTS = Path(__file__).parent / "scripts"
ENV_FILE = "/etc/s4kv/server.env"
SERVER_PORT = 8000
# S4KV_ROOT and S4KV_PORT are unset on an instance (cloud-init runs user data with a clean environment), so
# every path is the real one and the port is SERVER_PORT; the boot test (tests/deploy/test_boot.py) sets them
# to a scratch folder and a free port to run this same script.
ROOT_LINE = 'S4KV_ROOT="${S4KV_ROOT:-}"\n'
PORT_LINE = f'S4KV_PORT="${{S4KV_PORT:-{SERVER_PORT}}}"\n'

# env var in server.env -> the Fn::Sub variable that fills it
ENV_VARIABLES = {
    "S4KV_MODEL": "ModelId",
    "S4KV_SCHEME": "Scheme",
    "S4KV_INSTANCE_TYPE": "InstanceType",
    "S4KV_VLLM_ARGS": "VllmArgs",
    "S4KV_EXTRA_ARGS": "ExtraVllmArgs",
    "S4KV_API_KEY_SECRET_ARN": "ApiKeySecretArn",
    "S4KV_HF_TOKEN_SECRET_ARN": "HfTokenSecretArn",
    "S4KV_LOG_GROUP": "LogGroupName",
    "S4KV_BOOT_TIMEOUT": "BootTimeout",
    "S4KV_SIGNAL_RESOURCE": "SignalResource",
    "S4KV_STACK_NAME": "AWS::StackName",
    "AWS_REGION": "AWS::Region",
}
INSTALL_VARIABLES = {
    "S4KV_ARTIFACT_BUCKET": "ArtifactBucket",
    "S4KV_WHEEL_KEY": "WheelKey",
    "S4KV_WHEEL_SHA256": "WheelSha256",
    "S4KV_WHEEL_NAME": "WheelName",
    "S4KV_LOCK_KEY": "LockKey",
    "S4KV_LOCK_SHA256": "LockSha256",
}


def script(name: str) -> str:
    return (SCRIPTS / name).read_text()


def _write_file(path: str, content: str, mode: str) -> str:
    # A quoted heredoc delimiter: the shell writes the content verbatim, no expansion.
    return f'cat > "$S4KV_ROOT{path}" <<\'S4KV_EOF\'\n{content}S4KV_EOF\nchmod {mode} "$S4KV_ROOT{path}"\n'


def install_script() -> str:
    """Installs the runtime from the artifact bucket, the launcher and the systemd unit (not started)."""
    return (
        script("install-runtime.sh")
        + 'S4KV_REASON="writing the launcher and the systemd units"\n'
        + _write_file("/opt/s4kv/bin/start-server", script("start-server.sh"), "0755")
        + _write_file("/etc/systemd/system/s4kv.service", script("s4kv.service"), "0644")
        + _write_file("/etc/systemd/system/s4kv-metrics.service", script("s4kv-metrics.service"), "0644")
        + _write_file("/etc/systemd/system/s4kv-metrics.timer", script("s4kv-metrics.timer"), "0644")
    )


def env_file_template(with_install: bool) -> str:
    """Fn::Sub template of the env file (single-quoted values: the parameters' AllowedPatterns have no quotes)."""
    variables = {**ENV_VARIABLES, **(INSTALL_VARIABLES if with_install else {})}
    lines = [f"{env}='${{{sub}}}'" for env, sub in variables.items()]
    return ('install -d "$S4KV_ROOT/etc/s4kv"\n' + _write_file(ENV_FILE, "\n".join(lines) + "\n", "0644")
            + f'echo "S4KV_PORT=\'$S4KV_PORT\'" >> "$S4KV_ROOT{ENV_FILE}"\n')


def user_data(with_install: bool, variables: dict[str, str]) -> str:
    """Base64 user data (a token). ``variables`` fills the Fn::Sub names of ENV_VARIABLES (and
    INSTALL_VARIABLES when ``with_install``); the AWS:: ones are CloudFormation's own."""
    expected = {v for v in ENV_VARIABLES.values() if not v.startswith("AWS::")}
    if with_install:
        expected |= set(INSTALL_VARIABLES.values())
    if set(variables) != expected:
        raise ValueError(f"user data needs exactly {sorted(expected)}, got {sorted(variables)}")
    parts = [
        "#!/bin/bash\n"
        "# S4 KV bootstrap: settings, logs, install (DLAMI flavour), start, readiness signal. No secret here.\n"
        "set -euo pipefail\n" + ROOT_LINE + PORT_LINE,
        Fn.sub(env_file_template(with_install), variables),
        f'# shellcheck source=/dev/null\n. "$S4KV_ROOT{ENV_FILE}"\n',
        script("signal.sh"),
        script("logs.sh"),
    ]
    if with_install:
        parts.append(install_script())
    parts.append(script("boot.sh"))
    return Fn.base64(Fn.join("", parts))
