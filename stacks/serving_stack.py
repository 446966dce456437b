"""GPU serving stack: parameters, then the constructs of constructs_lib/, then outputs. No logic of its own
beyond wiring; the per-instance vLLM settings come from ``s4kv capacity`` via constructs_lib.serving_plan.

Flavours: ``dlami`` installs the runtime at boot on the AWS Deep Learning AMI found through its public
SSM parameter, from the wheel and lock of constructs_lib.runtime_artifacts (CDK assets for ``cdk deploy``,
template parameters for the export); ``marketplace`` boots a baked AMI (stacks/ami_stack.py) given as the
ImageId parameter and installs nothing.
"""

from __future__ import annotations

from aws_cdk import Aws, CfnCondition, CfnMapping, CfnOutput, CfnParameter, Fn, Stack, Token, aws_logs as logs
from constructs import Construct

from constructs_lib import regions, serving_plan
from constructs_lib.api_key import ApiKeySecret
from constructs_lib.network import ServingNetwork
from constructs_lib.operations import ServerOperations
from constructs_lib.runtime_artifacts import CUDA_LOCK, WHEEL_NAME, RuntimeArtifacts, build_wheel
from constructs_lib.server_instance import ServerInstance
from constructs_lib.server_role import ServerRole
from constructs_lib.settings import DeploySettings
from constructs_lib.user_data import SERVER_PORT, user_data
from s4kv.runtime.schemes import SERVED_SCHEMES
from stacks.nag import acknowledge

# The x86_64 "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 24.04)", by the naming rule of the DLAMI
# guide's "Finding the ID of a DLAMI" page (docs/deploy.md says which spelling and why). Ubuntu 24.04: its
# python3 is 3.12, the Python of the runtime lock (deploy/locks/runtime-cuda.txt).
DLAMI_SSM_PARAMETER = "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-24.04/latest/ami-id"
CIDR_PATTERN = r"^(\d{1,3})\.(\d{1,3})\.(\d{1,3})\.(\d{1,3})/(\d{1,2})$"
VLLM_ARGS_PATTERN = r"^[A-Za-z0-9 ._=,:/+-]*$"  # no quotes or shell metacharacters: written to a sourced file
BOOT_TIMEOUT_PATTERN = r"^PT([1-9][0-9]{0,2})M$"  # whole minutes, at most 999 (CloudFormation allows 12 h)
SECRET_ARN_PATTERN = r"^(arn:aws[a-z-]*:secretsmanager:[a-z0-9-]+:\d{12}:secret:[A-Za-z0-9/_+=.@-]+)?$"
SCHEMES = list(SERVED_SCHEMES)


class GpuServingStack(Stack):
    def __init__(self, scope: Construct, id: str, *, settings: DeploySettings, artifacts_from: str = "assets",
                 **kwargs) -> None:
        """``artifacts_from``: ``assets`` (``cdk deploy``) or ``parameters`` (the exported template)."""
        super().__init__(scope, id, **kwargs)
        plans = serving_plan.plans_for(settings.model_source, settings.max_model_len)
        if settings.instance_type not in plans:
            raise ValueError(f"{settings.model_id} does not fit on {settings.instance_type}; "
                             f"it fits on: {', '.join(plans)}")
        marketplace = settings.flavour == "marketplace"
        self.template_options.description = (
            f"S4 KV: {settings.model_id} behind vLLM's OpenAI-compatible API (port {SERVER_PORT}) with an int4 KV "
            f"cache, on one GPU instance ({'baked AMI' if marketplace else 'AWS Deep Learning AMI'}).")
        p = self._parameters(settings, plans, marketplace)

        is_bf16 = CfnCondition(self, "IsBf16", expression=Fn.condition_equals(p["Scheme"].value_as_string, "bf16"))
        is_saw = CfnCondition(self, "IsInt4Saw",
                              expression=Fn.condition_equals(p["Scheme"].value_as_string, "int4_saw"))
        zone_given = CfnCondition(self, "ZoneGiven", expression=Fn.condition_not(
            Fn.condition_equals(p["AvailabilityZone"].value_as_string, "")))
        plan_table = CfnMapping(self, serving_plan.MAPPING_NAME, mapping=serving_plan.mapping(plans))
        instance_type = p["InstanceType"].value_as_string

        def plan_value(key: str) -> str:
            return plan_table.find_in_map(instance_type, key)

        # A zone the user names, else the first zone ID of this region that offers the instance type (offline
        # snapshot, constructs_lib/region_offerings.json); a region or type missing from it fails the deploy at
        # the subnet, before any instance is launched, and the AvailabilityZone parameter overrides.
        zones = CfnMapping(self, "ZoneIds", mapping=regions.zone_mapping(list(plans)))
        zone = Token.as_string(Fn.condition_if(zone_given.logical_id, p["AvailabilityZone"].value_as_string,
                                               Aws.NO_VALUE))
        zone_id = Token.as_string(Fn.condition_if(zone_given.logical_id, Aws.NO_VALUE,
                                                  zones.find_in_map(Aws.REGION, plan_value("ZoneKey"))))
        network = ServingNetwork(self, "Network", availability_zone=zone, availability_zone_id=zone_id,
                                 allowed_cidr=p["AllowedCidr"].value_as_string, port=SERVER_PORT)
        api_key = ApiKeySecret(self, "ApiKey", supplied_secret_arn=p["ApiKeySecretArn"].value_as_string)
        hf_token = p["HfTokenSecretArn"].value_as_string
        has_hf_token = CfnCondition(self, "HasHfToken", expression=Fn.condition_not(Fn.condition_equals(hf_token, "")))
        log_group = logs.CfnLogGroup(self, "ServerLogs", retention_in_days=30)
        artifacts = None
        if not marketplace:
            artifacts = (RuntimeArtifacts.from_parameters(self) if artifacts_from == "parameters" else
                         RuntimeArtifacts.from_assets(self, build_wheel(), CUDA_LOCK))
        role = ServerRole(self, "Server", log_group_arn=log_group.attr_arn,
                          secret_arns=[api_key.secret_arn, Token.as_string(
                              Fn.condition_if(has_hf_token.logical_id, hf_token, Aws.NO_VALUE))],
                          artifact_statement=artifacts.read_statement() if artifacts else None)
        args_key = serving_plan.ARGS_KEYS
        vllm_args = Token.as_string(Fn.condition_if(
            is_bf16.logical_id, plan_value(args_key["bf16"]),
            Fn.condition_if(is_saw.logical_id, plan_value(args_key["int4_saw"]), plan_value(args_key["int4_kivi"]))))
        image = p["ImageId"] if marketplace else p["DeepLearningAmi"]
        signal_resource = ServerInstance.LOGICAL_ID  # the resource the boot script signals
        variables = {
            "ModelId": settings.model_id, "Scheme": p["Scheme"].value_as_string, "InstanceType": instance_type,
            "VllmArgs": vllm_args, "ExtraVllmArgs": p["ExtraVllmArgs"].value_as_string,
            "ApiKeySecretArn": api_key.secret_arn, "HfTokenSecretArn": hf_token, "LogGroupName": log_group.ref,
            "BootTimeout": p["BootTimeout"].value_as_string, "SignalResource": signal_resource,
        }
        if artifacts:
            variables.update(artifacts.user_data_variables(), WheelName=WHEEL_NAME)
        server = ServerInstance(
            self, "Gpu", image_id=image.value_as_string, instance_type=instance_type,
            subnet_id=network.subnet.ref, security_group_id=network.security_group.ref,
            instance_profile=role.instance_profile.ref, root_volume_gib=p["RootVolumeGiB"].value_as_number,
            user_data=user_data(not marketplace, variables), boot_timeout=p["BootTimeout"].value_as_string)
        server.instance.add_resource_dependency(network.dependable)
        operations = ServerOperations(self, "Operations")
        operations.health_alarm.node.add_dependency(server.instance)
        self.server, self.network, self.role, self.api_key = server, network, role, api_key
        self._outputs(server, api_key, log_group, plan_value, vllm_args)
        CfnOutput(self, "HealthAlarm", value=operations.health_alarm.alarm_name,
                  description="CloudWatch alarm: /health failing for 3 minutes (attach an SNS action to be told)")
        CfnOutput(self, "Dashboard", value=operations.dashboard.dashboard_name,
                  description="CloudWatch dashboard: health, KV cache usage, requests, tokens/s, TTFT, ITL")
        self._acknowledge()

    def _acknowledge(self) -> None:
        """Each finding this design accepts, on the construct it concerns, with the reason."""
        acknowledge(self.network.security_group, (
            "AwsSolutions::AwsSolutions-EC23",
            "The only ingress is TCP 8000 from the AllowedCidr parameter, which has no default; cdk-nag cannot "
            "evaluate a parameter. Egress is limited to 80 and 443."))
        acknowledge(self.server.instance, (
            "AwsSolutions::AwsSolutions-EC29",
            "A single serving instance owned by this stack: deleting or replacing the stack must be able to "
            "terminate it, which termination protection would block; nothing on it is persistent."))
        acknowledge(self.role.role, (
            "AwsSolutions::AwsSolutions-IAM5[Resource::*]",
            "Only the five Session Manager actions (ssm:UpdateInstanceInformation, ssmmessages:*Channel) and "
            "cloudwatch:PutMetricData (held to the S4KV namespace by a condition) use Resource *: they support no "
            "resource-level permissions. Logs, secrets, artifacts and the signal are scoped to their ARNs."))
        acknowledge(self.api_key.secret, (
            "AwsSolutions::AwsSolutions-SMG4",
            "A static bearer key shared with API clients: automatic rotation would break them without notice. "
            "Rotate by hand (put-secret-value, then restart s4kv.service, which re-reads it); docs/deploy.md."))
        acknowledge(self.network.subnet, (
            "CloudFormation-Validate::F3020",
            "Exactly one is set: AvailabilityZone and AvailabilityZoneId are both Fn::If on ZoneGiven, each with "
            "AWS::NoValue in the branch where the other one applies."))
        acknowledge(self, (
            "CloudFormation-Validate::W1001",
            "The generated secret is only referenced inside Fn::If on its own condition (GenerateApiKey)."), (
            "CloudFormation-Validate::W2509",
            "ApiKeySecretArn holds the ARN of a secret, not a secret: the key itself never enters the template."))

    def _parameters(self, settings: DeploySettings, plans: dict, marketplace: bool) -> dict:
        p = {}
        instance_types = list(plans)

        def param(name: str, **kwargs) -> None:
            p[name] = CfnParameter(self, name, **kwargs)

        param("InstanceType", type="String", default=settings.instance_type, allowed_values=instance_types,
              description=f"GPU instance type (those on which {settings.model_id} fits)")
        param("Scheme", type="String", default=settings.scheme, allowed_values=SCHEMES,
              description="KV cache: int4_kivi or int4_saw (S4 KV), bf16 (plain vLLM, for comparison)")
        cidr = dict(type="String", allowed_pattern=CIDR_PATTERN,
                    constraint_description="an IPv4 CIDR such as 203.0.113.7/32",
                    description="Who may call port 8000 (IPv4 CIDR, e.g. your address/32). No default on purpose.")
        if settings.allowed_cidr:
            cidr["default"] = settings.allowed_cidr
        param("AllowedCidr", **cidr)
        param("ApiKeySecretArn", type="String", default="", allowed_pattern=SECRET_ARN_PATTERN,
              description="Existing Secrets Manager secret (plain-text value) holding the API key; empty: generate one")
        hf = dict(type="String", allowed_pattern=SECRET_ARN_PATTERN)
        if settings.gated:
            hf.update(allowed_pattern=SECRET_ARN_PATTERN.replace(")?$", ")$"),
                      description=f"Secrets Manager secret (plain text) holding a Hugging Face token allowed to "
                                  f"download {settings.model_id} (a gated model): required")
            if settings.hf_token_secret_arn:
                hf["default"] = settings.hf_token_secret_arn
        else:
            hf.update(default=settings.hf_token_secret_arn or "",
                      description="Secrets Manager secret (plain text) holding a Hugging Face token; empty: none")
        param("HfTokenSecretArn", **hf)
        default_boot = plans[settings.instance_type].boot_timeout() if settings.instance_type in plans else "PT60M"
        param("BootTimeout", type="String", default=default_boot, allowed_pattern=BOOT_TIMEOUT_PATTERN,
              constraint_description="PT<minutes>M, e.g. PT45M",
              description="How long CloudFormation waits for the instance's ready signal (install, model download, "
                          "load, one completion); default: the estimate for the default instance type (the "
                          "ServingPlans mapping's BootTimeout has each type's)")
        param("RootVolumeGiB", type="Number", default=200, min_value=100, max_value=16384,
              description="Size of the encrypted gp3 root volume (GiB): runtime plus model weights")
        param("AvailabilityZone", type="String", default="",
              description="Zone name for the instance (empty: the first zone of the region that offers the "
                          "instance type, by zone ID, from an offline snapshot of EC2's offerings)")
        # bounded so that the user data, with every parameter substituted, stays within EC2's 16 KB
        param("ExtraVllmArgs", type="String", default="", allowed_pattern=VLLM_ARGS_PATTERN, max_length=512,
              description="More vLLM flags, e.g. --enable-prefix-caching (letters, digits, space and ._=,:/+- only)")
        if marketplace:
            param("ImageId", type="AWS::EC2::Image::Id",
                  description="The S4 KV AMI of this region (built by the S4 KV Image Builder recipe)")
        else:
            param("DeepLearningAmi", type="AWS::SSM::Parameter::Value<AWS::EC2::Image::Id>",
                  default=DLAMI_SSM_PARAMETER, description="Public SSM parameter of the AWS Deep Learning AMI")
        return p

    def _outputs(self, server, api_key, log_group, plan_value, vllm_args) -> None:
        dns = server.instance.attr_public_dns_name
        CfnOutput(self, "Endpoint", value=Fn.join("", ["http://", dns, f":{SERVER_PORT}/v1"]),
                  description="OpenAI-compatible base URL (send the API key as a Bearer token)")
        CfnOutput(self, "HealthUrl", value=Fn.join("", ["http://", dns, f":{SERVER_PORT}/health"]),
                  description="Health check, no key needed: 200 once the model is loaded")
        CfnOutput(self, "ApiKeySecret", value=api_key.secret_arn, description="Secrets Manager secret of the API key")
        CfnOutput(self, "GetApiKeyCommand", description="How to read the API key",
                  value=Fn.join("", ["aws secretsmanager get-secret-value --region ", self.region, " --secret-id ",
                                     api_key.secret_arn, " --query SecretString --output text"]))
        CfnOutput(self, "InstanceId", value=server.instance.ref)
        CfnOutput(self, "SessionManagerCommand", value=Fn.join("", [
            "aws ssm start-session --region ", self.region, " --target ", server.instance.ref]))
        CfnOutput(self, "LogGroup", value=log_group.ref, description="Server and boot logs (CloudWatch Logs)")
        CfnOutput(self, "BootLogCommand", description="Follow the boot and the server log",
                  value=Fn.join("", ["aws logs tail --region ", self.region, " --follow ", log_group.ref]))
        CfnOutput(self, "VllmSettings", value=vllm_args, description="vLLM flags derived for this instance type")
        CfnOutput(self, "CapacityEstimate", value=plan_value("Capacity"),
                  description="Concurrent requests the KV cache holds (s4kv capacity)")
