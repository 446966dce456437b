"""The instance's boot script, from the files in scripts/ (also used by the baked-AMI recipe).

User data = an env file with the deployment's settings (the only part CloudFormation substitutes,
with Fn::Sub), then, for the DLAMI flavour, the runtime install, then the boot steps. The API key is
not in it: scripts/start-server.sh fetches it from Secrets Manager each time the server starts.
"""

from __future__ import annotations

from pathlib import Path

from aws_cdk import Fn

SCRIPTS = Path(__file__).parent / "scripts"
ENV_FILE = "/etc/s4kv/server.env"
SERVER_PORT = 8000

# env var in server.env -> the Fn::Sub variable that fills it
ENV_VARIABLES = {
    "S4KV_MODEL": "ModelId",
    "S4KV_SCHEME": "Scheme",
    "S4KV_VLLM_ARGS": "VllmArgs",
    "S4KV_EXTRA_ARGS": "ExtraVllmArgs",
    "S4KV_API_KEY_SECRET_ARN": "ApiKeySecretArn",
    "S4KV_LOG_GROUP": "LogGroupName",
    "AWS_REGION": "AWS::Region",
}
INSTALL_VARIABLES = {"S4KV_PIP_SPEC": "S4kvPipSpec", "VLLM_PIP_SPEC": "VllmPipSpec"}


def script(name: str) -> str:
    return (SCRIPTS / name).read_text()


def _write_file(path: str, content: str, mode: str) -> str:
    # A quoted heredoc delimiter: the shell writes the content verbatim, no expansion.
    return f"cat > {path} <<'S4KV_EOF'\n{content}S4KV_EOF\nchmod {mode} {path}\n"


def install_script() -> str:
    """Installs vLLM + the plugin, the CloudWatch agent, the launcher and the systemd unit (not started)."""
    return (
        script("install-runtime.sh")
        + _write_file("/opt/s4kv/bin/start-server", script("start-server.sh"), "0755")
        + _write_file("/etc/systemd/system/s4kv.service", script("s4kv.service"), "0644")
    )


def env_file_template(with_install: bool) -> str:
    """Fn::Sub template of the user data's first part: writes server.env (single-quoted values: the
    template's parameters have AllowedPatterns without quotes)."""
    variables = {**ENV_VARIABLES, **(INSTALL_VARIABLES if with_install else {})}
    lines = [f"{env}='${{{sub}}}'" for env, sub in variables.items()] + [f"S4KV_PORT='{SERVER_PORT}'"]
    return (
        "#!/bin/bash\n"
        "# S4 KV bootstrap: settings, install (DLAMI flavour), start. No secret here: the server fetches\n"
        "# its API key from Secrets Manager when it starts.\n"
        "set -euo pipefail\n"
        "install -d /etc/s4kv\n"
        + _write_file(ENV_FILE, "\n".join(lines) + "\n", "0644")
    )


def user_data(with_install: bool, variables: dict[str, str]) -> str:
    """Base64 user data (a token). ``variables`` fills the Fn::Sub names of ENV_VARIABLES (and
    INSTALL_VARIABLES when ``with_install``); AWS::Region is CloudFormation's own."""
    expected = {v for v in ENV_VARIABLES.values() if not v.startswith("AWS::")}
    if with_install:
        expected |= set(INSTALL_VARIABLES.values())
    if set(variables) != expected:
        raise ValueError(f"user data needs exactly {sorted(expected)}, got {sorted(variables)}")
    parts = [Fn.sub(env_file_template(with_install), variables), f"# shellcheck source=/dev/null\n. {ENV_FILE}\n"]
    if with_install:
        parts.append(install_script())
    parts.append(script("boot.sh"))
    return Fn.base64(Fn.join("", parts))
