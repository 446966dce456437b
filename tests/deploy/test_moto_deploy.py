"""Deploy the exported templates into moto's server (loopback only): create, update and delete, one
stack per instance type (the rendered user data's flags), a StackSet over the test regions, and the
CDK CLI's own deploy of the multi-region app. moto lacks CloudFormation support for Secrets Manager
secrets, so the stacks here use the supplied-secret path (a secret created in moto)."""

from __future__ import annotations

import base64
import datetime
import os
import shutil
import socket
import subprocess

import pytest
import yaml

from deploy_support import REGIONS, REPO

moto_server = pytest.importorskip("moto.server")
pytestmark = pytest.mark.filterwarnings("ignore:Tried to parse AWS")  # moto: no CFN secrets
boto3 = pytest.importorskip("boto3")

from constructs_lib.serving_plan import ARGS_KEYS  # noqa: E402
from stacks.serving_stack import DLAMI_SSM_PARAMETER as DLAMI_PARAMETER  # noqa: E402
CIDR = "203.0.113.7/32"
# Where the exported template's instance would fetch the runtime (test_boot.py boots from real ones).
ARTIFACTS = {"ArtifactBucket": "s4kv-artifacts", "WheelKey": "s4kv/0a1b/s4kv-0.1.0-py3-none-any.whl",
             "WheelSha256": "0" * 64, "LockKey": "s4kv/2c3d/runtime-cuda.txt", "LockSha256": "1" * 64}
KEY_VALUE = "moto-test-api-key-0f1e2d3c4b5a69788796a5b4"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Moto:
    def __init__(self) -> None:
        from moto.core import DEFAULT_ACCOUNT_ID

        self.account = DEFAULT_ACCOUNT_ID
        self.port = _free_port()
        self.server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        # The CDK CLI reaches moto by name: AWS_ENDPOINT_URL must say localhost, not 127.0.0.1.
        self.url = f"http://localhost:{self.port}"

    def client(self, service: str, region: str = REGIONS[0]):
        return boto3.client(service, region_name=region, endpoint_url=self.url,
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    def put_public_dlami_parameter(self, region: str) -> str:
        """moto refuses PutParameter under /aws/, like AWS: the public parameter goes into its backend."""
        from moto.ssm.models import Parameter, ssm_backends

        ami = self.client("ec2", region).describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
        ssm_backends[self.account][region]._parameters[DLAMI_PARAMETER].append(Parameter(
            account_id=self.account, name=DLAMI_PARAMETER, value=ami, parameter_type="String", description=None,
            allowed_pattern=None, keyid=None, last_modified_date=datetime.datetime.now(), version=1,
            data_type="aws:ec2:image"))
        return ami


@pytest.fixture(scope="module")
def moto():
    server = Moto()
    server.server.start()
    server.amis = {region: server.put_public_dlami_parameter(region) for region in REGIONS}
    yield server
    server.server.stop()


@pytest.fixture(scope="module")
def api_key_arn(moto):
    return moto.client("secretsmanager").create_secret(Name="s4kv-api-key", SecretString=KEY_VALUE)["ARN"]


def _params(**values) -> list[dict]:
    return [{"ParameterKey": k, "ParameterValue": v} for k, v in values.items()]


def _resources(cfn, stack: str) -> dict[str, str]:
    """resource type -> physical id (moto omits the types it does not implement)."""
    return {r["ResourceType"]: r["PhysicalResourceId"]
            for r in cfn.describe_stack_resources(StackName=stack)["StackResources"] if "ResourceType" in r}


def _delete(moto, stack: str, region: str = REGIONS[0]) -> None:
    """delete_stack, after undoing what moto 5.2.5 cannot delete itself (CloudFormation can): the gateway
    attachment, the flow log and the route table; otherwise moto refuses to delete the VPC."""
    cfn = moto.client("cloudformation", region)
    _undo_what_moto_cannot_delete(moto, stack, region)
    cfn.delete_stack(StackName=stack)


def _undo_what_moto_cannot_delete(moto, stack: str, region: str) -> None:
    ec2 = moto.client("ec2", region)
    vpcs = [r["PhysicalResourceId"] for r in moto.client("cloudformation", region).describe_stack_resources(
        StackName=stack)["StackResources"] if r.get("ResourceType") == "AWS::EC2::VPC"]
    for vpc in vpcs:
        for gateway in ec2.describe_internet_gateways(
                Filters=[{"Name": "attachment.vpc-id", "Values": [vpc]}])["InternetGateways"]:
            ec2.detach_internet_gateway(InternetGatewayId=gateway["InternetGatewayId"], VpcId=vpc)
        flow_logs = [f["FlowLogId"] for f in ec2.describe_flow_logs(
            Filters=[{"Name": "resource-id", "Values": [vpc]}])["FlowLogs"]]
        if flow_logs:
            ec2.delete_flow_logs(FlowLogIds=flow_logs)
        for table in ec2.describe_route_tables(Filters=[{"Name": "vpc-id", "Values": [vpc]}])["RouteTables"]:
            if any(a.get("Main") for a in table["Associations"]):
                continue
            for association in table["Associations"]:
                ec2.disassociate_route_table(AssociationId=association["RouteTableAssociationId"])
            ec2.delete_route_table(RouteTableId=table["RouteTableId"])


def _launch_template_version(moto, stack: str, region: str = REGIONS[0]) -> dict:
    """The latest version of the stack's launch template: what its instance boots (the user data lives there)."""
    template_id = _resources(moto.client("cloudformation", region), stack)["AWS::EC2::LaunchTemplate"]
    [version] = moto.client("ec2", region).describe_launch_template_versions(
        LaunchTemplateId=template_id, Versions=["$Latest"])["LaunchTemplateVersions"]
    return version


def _user_data(moto, stack: str, region: str = REGIONS[0]) -> str:
    return base64.b64decode(_launch_template_version(moto, stack, region)["LaunchTemplateData"]["UserData"]).decode()


def _env_value(user_data: str, name: str) -> str:
    line = next(row for row in user_data.splitlines() if row.startswith(f"{name}="))
    return line.split("=", 1)[1].strip("'")


def test_create_update_delete_of_the_exported_template(moto, api_key_arn):
    cfn, ec2 = moto.client("cloudformation"), moto.client("ec2")
    body = (REPO / "deploy" / "cfn-gpu-serving.yaml").read_text()
    cfn.create_stack(StackName="s4kv", TemplateBody=body, Capabilities=["CAPABILITY_IAM"], Parameters=_params(
        AllowedCidr=CIDR, InstanceType="g6e.12xlarge", ApiKeySecretArn=api_key_arn, **ARTIFACTS))
    stack = cfn.describe_stacks(StackName="s4kv")["Stacks"][0]
    assert stack["StackStatus"] == "CREATE_COMPLETE"
    resources = _resources(cfn, "s4kv")
    assert {"AWS::EC2::VPC", "AWS::EC2::Subnet", "AWS::EC2::SecurityGroup", "AWS::EC2::FlowLog", "AWS::IAM::Role",
            "AWS::IAM::InstanceProfile", "AWS::Logs::LogGroup", "AWS::EC2::Instance"} <= set(resources)
    instance = ec2.describe_instances(InstanceIds=[resources["AWS::EC2::Instance"]])["Reservations"][0]["Instances"][0]
    assert instance["InstanceType"] == "g6e.12xlarge" and instance["ImageId"] == moto.amis[REGIONS[0]]
    group = ec2.describe_security_groups(GroupIds=[resources["AWS::EC2::SecurityGroup"]])["SecurityGroups"][0]
    assert [(p["FromPort"], p["ToPort"], [r["CidrIp"] for r in p["IpRanges"]]) for p in group["IpPermissions"]] == [
        (8000, 8000, [CIDR])]
    outputs = {o["OutputKey"]: o["OutputValue"] for o in stack["Outputs"]}
    assert outputs["ApiKeySecret"] == api_key_arn
    assert outputs["VllmSettings"] == ("--tensor-parallel-size 1 --data-parallel-size 4 --max-model-len 32768 "
                                       "--gpu-memory-utilization 0.9 --max-num-seqs 256")
    assert outputs["InstanceId"] == instance["InstanceId"] and outputs["Endpoint"].endswith(":8000/v1")
    assert f"--secret-id {api_key_arn}" in outputs["GetApiKeyCommand"]
    user_data = _user_data(moto, "s4kv")
    assert _env_value(user_data, "S4KV_API_KEY_SECRET_ARN") == api_key_arn
    assert _env_value(user_data, "S4KV_WHEEL_KEY") == ARTIFACTS["WheelKey"]
    # The key's value is nowhere CloudFormation or EC2 can show it.
    template = cfn.get_template(StackName="s4kv")["TemplateBody"]
    for text in (user_data, str(template), str(stack)):
        assert KEY_VALUE not in text

    cfn.update_stack(StackName="s4kv", TemplateBody=body, Capabilities=["CAPABILITY_IAM"], Parameters=_params(
        AllowedCidr="198.51.100.0/24", InstanceType="g6e.12xlarge", ApiKeySecretArn=api_key_arn, **ARTIFACTS))
    assert cfn.describe_stacks(StackName="s4kv")["Stacks"][0]["StackStatus"] == "UPDATE_COMPLETE"
    group = ec2.describe_security_groups(GroupIds=[_resources(cfn, "s4kv")["AWS::EC2::SecurityGroup"]])
    assert group["SecurityGroups"][0]["IpPermissions"][0]["IpRanges"][0]["CidrIp"] == "198.51.100.0/24"

    _delete(moto, "s4kv")
    statuses = {s["StackName"]: s["StackStatus"] for s in cfn.list_stacks()["StackSummaries"]}
    assert statuses["s4kv"] == "DELETE_COMPLETE"
    state = ec2.describe_instances(InstanceIds=[instance["InstanceId"]])["Reservations"][0]["Instances"][0]["State"]
    assert state["Name"] == "terminated"


def test_rendered_user_data_starts_the_server_with_each_instance_types_flags(moto, api_key_arn):
    cfn = moto.client("cloudformation")
    text = (REPO / "deploy" / "cfn-gpu-serving.yaml").read_text()
    mappings = yaml.safe_load(text)["Mappings"]
    # The types a zone of the region offers (the ZoneIds mapping); any other one fails at the subnet, before launch.
    offered = mappings["ZoneIds"][REGIONS[0]]
    plans = {name: row for name, row in mappings["ServingPlans"].items() if row["ZoneKey"] in offered}
    assert "g6.xlarge" in plans and "p5e.48xlarge" not in plans
    for index, (instance_type, row) in enumerate(plans.items()):
        scheme = ("int4_kivi", "int4_saw", "bf16")[index % 3]
        name = f"flags-{index}"
        cfn.create_stack(StackName=name, TemplateBody=text, Capabilities=["CAPABILITY_IAM"], Parameters=_params(
            AllowedCidr=CIDR, InstanceType=instance_type, Scheme=scheme, ApiKeySecretArn=api_key_arn, **ARTIFACTS))
        user_data = _user_data(moto, name)
        assert _env_value(user_data, "S4KV_SCHEME") == scheme
        assert _env_value(user_data, "S4KV_MODEL") == "Qwen/Qwen2.5-7B-Instruct"
        assert _env_value(user_data, "S4KV_VLLM_ARGS") == row[ARGS_KEYS[scheme]]
        assert 'exec "$S4KV_HOME/venv/bin/s4kv" serve "$S4KV_MODEL" --scheme "$S4KV_SCHEME"' in user_data
        _delete(moto, name)


def test_update_of_the_scheme_changes_what_the_instance_runs(moto, api_key_arn):
    """A new scheme is a new launch-template version; the instance names the latest version, which on AWS means
    a replacement instance booting the new settings (moto keeps the old instance: it does not replace on update;
    tests/deploy/test_templates.py checks the Version reference that makes AWS replace it)."""
    cfn = moto.client("cloudformation")
    body = (REPO / "deploy" / "cfn-gpu-serving.yaml").read_text()

    def deploy(action, scheme: str, extra: str) -> str:
        action(StackName="swap", TemplateBody=body, Capabilities=["CAPABILITY_IAM"], Parameters=_params(
            AllowedCidr=CIDR, ApiKeySecretArn=api_key_arn, Scheme=scheme, ExtraVllmArgs=extra, **ARTIFACTS))
        return _user_data(moto, "swap")

    before = deploy(cfn.create_stack, "int4_kivi", "")
    first = _launch_template_version(moto, "swap")["VersionNumber"]
    after = deploy(cfn.update_stack, "int4_saw", "--enable-prefix-caching")
    assert cfn.describe_stacks(StackName="swap")["Stacks"][0]["StackStatus"] == "UPDATE_COMPLETE"
    assert _launch_template_version(moto, "swap")["VersionNumber"] == first + 1
    assert (_env_value(before, "S4KV_SCHEME"), _env_value(after, "S4KV_SCHEME")) == ("int4_kivi", "int4_saw")
    assert _env_value(after, "S4KV_EXTRA_ARGS") == "--enable-prefix-caching"
    _delete(moto, "swap")


def test_marketplace_template_boots_the_given_image(moto, api_key_arn):
    cfn = moto.client("cloudformation")
    body = (REPO / "deploy" / "cfn-gpu-serving-marketplace.yaml").read_text()
    ami = moto.amis[REGIONS[0]]
    cfn.create_stack(StackName="market", TemplateBody=body, Capabilities=["CAPABILITY_IAM"], Parameters=_params(
        AllowedCidr=CIDR, ImageId=ami, ApiKeySecretArn=api_key_arn))
    instance_id = _resources(cfn, "market")["AWS::EC2::Instance"]
    instance = moto.client("ec2").describe_instances(InstanceIds=[instance_id])["Reservations"][0]["Instances"][0]
    assert instance["ImageId"] == ami
    user_data = _user_data(moto, "market")
    assert "pip install" not in user_data and "systemctl enable --now s4kv.service" in user_data
    _delete(moto, "market")


def test_stack_set_over_the_regions(moto):
    cfn = moto.client("cloudformation")
    body = (REPO / "deploy" / "cfn-gpu-serving.yaml").read_text()
    cfn.create_stack_set(StackSetName="s4kv-fleet", TemplateBody=body, Capabilities=["CAPABILITY_IAM"],
                         Parameters=_params(AllowedCidr=CIDR, **ARTIFACTS))
    cfn.create_stack_instances(StackSetName="s4kv-fleet", Accounts=[moto.account], Regions=list(REGIONS))
    instances = cfn.list_stack_instances(StackSetName="s4kv-fleet")["Summaries"]
    assert sorted(i["Region"] for i in instances) == sorted(REGIONS)
    for region in REGIONS:
        stacks = moto.client("cloudformation", region).describe_stacks()["Stacks"]
        [stack] = [s for s in stacks if "s4kv-fleet" in s["StackName"]]
        assert stack["StackStatus"] == "CREATE_COMPLETE"
        assert "AWS::EC2::Instance" in _resources(moto.client("cloudformation", region), stack["StackName"])

    # (moto's UpdateStackSet does not reach the stack instances; the multi-region update is checked
    # through the CDK CLI below.)
    for region in REGIONS:
        stacks = moto.client("cloudformation", region).describe_stacks()["Stacks"]
        fleet_stack = next(s["StackName"] for s in stacks if "s4kv-fleet" in s["StackName"])
        _undo_what_moto_cannot_delete(moto, fleet_stack, region)
    cfn.delete_stack_instances(StackSetName="s4kv-fleet", Accounts=[moto.account], Regions=list(REGIONS),
                               RetainStacks=False)
    assert cfn.list_stack_instances(StackSetName="s4kv-fleet")["Summaries"] == []
    cfn.delete_stack_set(StackSetName="s4kv-fleet")


@pytest.mark.skipif(not (REPO / "node_modules" / ".bin" / "cdk").exists(), reason="CDK CLI not installed (npm ci)")
def test_cdk_cli_deploys_updates_and_destroys_the_multi_region_app(moto, api_key_arn):
    for region in REGIONS:  # what `cdk bootstrap` leaves behind, as far as deploying this app needs
        moto.client("ssm", region).put_parameter(Name="/cdk-bootstrap/hnb659fds/version", Value="30", Type="String")
        s3 = moto.client("s3", region)
        bucket = f"cdk-hnb659fds-assets-{moto.account}-{region}"
        s3.create_bucket(Bucket=bucket, **({} if region == "us-east-1" else
                                           {"CreateBucketConfiguration": {"LocationConstraint": region}}))
    env = {**os.environ, "AWS_ENDPOINT_URL": moto.url, "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": REGIONS[0], "CDK_DISABLE_CLI_TELEMETRY": "true",
           "JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION": "20"}
    cdk = [str(REPO / "node_modules" / ".bin" / "cdk"), "--no-notices", "-c", f"regions={','.join(REGIONS)}",
           "--output", str(REPO / "cdk.out" / "moto-test")]

    def deploy(cidr: str) -> None:
        # For moto 5.2.5: --method=direct, as its change sets cannot update an existing stack, and
        # --no-previous-parameters, as it fails on UsePreviousValue for a parameter left at its default.
        result = subprocess.run(cdk + ["deploy", "--all", "--method=direct", "--no-previous-parameters",
                                       "--require-approval", "never", "--parameters",
                                       f"AllowedCidr={cidr}", "--parameters", f"ApiKeySecretArn={api_key_arn}"],
                                cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]

    def check(status: str, cidr: str) -> None:
        for region in REGIONS:
            cfn = moto.client("cloudformation", region)
            stack = cfn.describe_stacks(StackName=f"S4kvServing-{region}")["Stacks"][0]
            assert stack["StackStatus"] == status
            resources = _resources(cfn, f"S4kvServing-{region}")
            assert "AWS::EC2::Instance" in resources
            group = moto.client("ec2", region).describe_security_groups(
                GroupIds=[resources["AWS::EC2::SecurityGroup"]])["SecurityGroups"][0]
            assert group["IpPermissions"][0]["IpRanges"][0]["CidrIp"] == cidr

    deploy(CIDR)
    check("CREATE_COMPLETE", CIDR)
    deploy("198.51.100.0/24")  # the update of the multi-region set
    check("UPDATE_COMPLETE", "198.51.100.0/24")
    for region in REGIONS:
        _undo_what_moto_cannot_delete(moto, f"S4kvServing-{region}", region)
    destroy = subprocess.run(cdk + ["destroy", "--all", "--force"], cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=300)
    assert destroy.returncode == 0, destroy.stderr[-3000:]
    for region in REGIONS:
        statuses = {s["StackName"]: s["StackStatus"]
                    for s in moto.client("cloudformation", region).list_stacks()["StackSummaries"]}
        assert statuses[f"S4kvServing-{region}"] == "DELETE_COMPLETE"
    shutil.rmtree(REPO / "cdk.out" / "moto-test", ignore_errors=True)
