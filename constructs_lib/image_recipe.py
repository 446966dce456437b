"""EC2 Image Builder recipe and pipeline that bake the S4 KV AMI for the marketplace flavour.

The AMI is the Deep Learning AMI plus exactly what the DLAMI flavour installs at boot (the same
install script), so an instance of it only writes its settings and starts the server.
Image Builder components and recipes are immutable per name and version: the names carry a hash of
the install script, so a changed script makes new ones instead of failing the update.
"""

from __future__ import annotations

import hashlib
import json

from aws_cdk import Fn, aws_iam as iam, aws_imagebuilder as imagebuilder
from constructs import Construct

from constructs_lib.user_data import install_script

VERSION = "1.0.0"
ROOT_VOLUME_GIB = 100


def component_document(vllm_pip_spec: str, s4kv_pip_spec: str) -> str:
    """The component's YAML document (JSON is YAML). The pip specs are fixed at synth time."""
    install = (f"set -euo pipefail\nVLLM_PIP_SPEC='{vllm_pip_spec}'\nS4KV_PIP_SPEC='{s4kv_pip_spec}'\n"
               + install_script())
    check = ("/opt/s4kv/venv/bin/python -c \"import vllm, s4kv.runtime; "
             "assert vllm.__version__ == '" + vllm_pip_spec.split("==")[-1] + "', vllm.__version__\"")
    return json.dumps({
        "name": "s4kv-runtime",
        "description": "vLLM and the S4 KV plugin in /opt/s4kv, the CloudWatch agent, the s4kv systemd unit",
        "schemaVersion": 1.0,
        "phases": [
            {"name": "build", "steps": [{"name": "InstallRuntime", "action": "ExecuteBash",
                                         "inputs": {"commands": [install]}}]},
            {"name": "validate", "steps": [{
                "name": "CheckRuntime", "action": "ExecuteBash",
                "inputs": {"commands": [check, "test -f /etc/systemd/system/s4kv.service"]}}]},
        ],
    }, indent=1)


class S4kvImagePipeline(Construct):
    def __init__(self, scope: Construct, id: str, *, parent_image: str, build_instance_type: str,
                 vllm_pip_spec: str, s4kv_pip_spec: str, regions: tuple[str, ...] = ()) -> None:
        super().__init__(scope, id)
        document = component_document(vllm_pip_spec, s4kv_pip_spec)
        tag = hashlib.sha256(document.encode()).hexdigest()[:10]
        component = imagebuilder.CfnComponent(
            self, "Component", name=f"s4kv-runtime-{tag}", platform="Linux", version=VERSION, data=document,
            description="S4 KV runtime: vLLM 0.26.0, the s4kv plugin, CloudWatch agent, systemd unit")
        recipe = imagebuilder.CfnImageRecipe(
            self, "Recipe", name=f"s4kv-server-{tag}", version=VERSION, parent_image=parent_image,
            components=[imagebuilder.CfnImageRecipe.ComponentConfigurationProperty(component_arn=component.attr_arn)],
            block_device_mappings=[imagebuilder.CfnImageRecipe.InstanceBlockDeviceMappingProperty(
                device_name="/dev/sda1", ebs=imagebuilder.CfnImageRecipe.EbsInstanceBlockDeviceSpecificationProperty(
                    volume_size=ROOT_VOLUME_GIB, volume_type="gp3", encrypted=True, delete_on_termination=True))])
        self.role = iam.CfnRole(
            self, "BuildRole",
            description="EC2 Image Builder build instance of the S4 KV AMI",
            assume_role_policy_document={"Version": "2012-10-17", "Statement": [{
                "Effect": "Allow", "Action": "sts:AssumeRole", "Principal": {"Service": "ec2.amazonaws.com"}}]},
            # The two policies Image Builder documents for its build instances.
            managed_policy_arns=[
                Fn.sub("arn:${AWS::Partition}:iam::aws:policy/EC2InstanceProfileForImageBuilder"),
                Fn.sub("arn:${AWS::Partition}:iam::aws:policy/AmazonSSMManagedInstanceCore"),
            ])
        profile = iam.CfnInstanceProfile(self, "BuildInstanceProfile", roles=[self.role.ref])
        infrastructure = imagebuilder.CfnInfrastructureConfiguration(
            self, "Infrastructure", name=f"s4kv-build-{tag}", instance_profile_name=profile.ref,
            instance_types=[build_instance_type], terminate_instance_on_failure=True,
            instance_metadata_options=imagebuilder.CfnInfrastructureConfiguration.InstanceMetadataOptionsProperty(
                http_tokens="required", http_put_response_hop_limit=2))
        # The regions that get the AMI: the listed ones (include the build region), else the build region.
        regions = list(regions) or [Fn.ref("AWS::Region")]
        distribution = imagebuilder.CfnDistributionConfiguration(
            self, "Distribution", name=f"s4kv-ami-{tag}",
            distributions=[imagebuilder.CfnDistributionConfiguration.DistributionProperty(
                region=region, ami_distribution_configuration={
                    "Name": "s4kv-server-{{ imagebuilder:buildDate }}",
                    "Description": "S4 KV server: vLLM 0.26.0 with int4 KV cache, boots into s4kv.service"})
                for region in regions])
        self.pipeline = imagebuilder.CfnImagePipeline(
            self, "Pipeline", name=f"s4kv-server-{tag}", image_recipe_arn=recipe.attr_arn,
            infrastructure_configuration_arn=infrastructure.attr_arn,
            distribution_configuration_arn=distribution.attr_arn, status="ENABLED",
            description="Manual runs: aws imagebuilder start-image-pipeline-execution --image-pipeline-arn ARN")
