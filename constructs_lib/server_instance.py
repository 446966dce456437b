"""The GPU instance: IMDSv2 only, encrypted gp3 root volume, detailed monitoring, no key pair; its user data in a
launch template, and a CreationPolicy that waits for the boot script's signal.

Why a launch template: cloud-init runs user data once per instance, so new settings must mean a new instance.
The instance names the template's LatestVersionNumber; a change of the user data is a new version, and a new
version of an instance's LaunchTemplate requires replacement. CloudFormation then creates the new instance,
waits for its SUCCESS signal, and only then terminates the old one.
"""

from __future__ import annotations

from aws_cdk import CfnCreationPolicy, CfnResourceSignal, Token, aws_ec2 as ec2
from constructs import Construct

ROOT_DEVICE = "/dev/sda1"  # the Ubuntu Deep Learning AMIs' root device


class ServerInstance(Construct):
    # A fixed logical id: the boot script signals the instance by it (scripts/signal.sh).
    LOGICAL_ID = "ServerInstance"

    def __init__(self, scope: Construct, id: str, *, image_id: str, instance_type: str, subnet_id: str,
                 security_group_id: str, instance_profile: str, root_volume_gib: int | float, user_data: str,
                 boot_timeout: str) -> None:
        super().__init__(scope, id)
        self.launch_template = ec2.CfnLaunchTemplate(
            self, "LaunchTemplate", version_description="S4 KV server boot script",
            launch_template_data=ec2.CfnLaunchTemplate.LaunchTemplateDataProperty(user_data=user_data))
        self.instance = ec2.CfnInstance(
            self, "Instance",
            launch_template=ec2.CfnInstance.LaunchTemplateSpecificationProperty(
                launch_template_id=self.launch_template.ref,
                version=Token.as_string(self.launch_template.attr_latest_version_number)),
            image_id=image_id,
            instance_type=instance_type,
            subnet_id=subnet_id,
            security_group_ids=[security_group_id],
            iam_instance_profile=instance_profile,
            monitoring=True,
            metadata_options=ec2.CfnInstance.MetadataOptionsProperty(
                http_tokens="required", http_endpoint="enabled", http_put_response_hop_limit=1),
            block_device_mappings=[ec2.CfnInstance.BlockDeviceMappingProperty(
                device_name=ROOT_DEVICE,
                ebs=ec2.CfnInstance.EbsProperty(volume_size=root_volume_gib, volume_type="gp3",
                                                encrypted=True, delete_on_termination=True))],
            tags=[{"key": "Name", "value": "s4kv-server"}],
        )
        self.instance.override_logical_id(self.LOGICAL_ID)
        self.instance.cfn_options.creation_policy = CfnCreationPolicy(
            resource_signal=CfnResourceSignal(count=1, timeout=boot_timeout))
