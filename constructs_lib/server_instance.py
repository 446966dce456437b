"""The GPU instance: IMDSv2 only, encrypted gp3 root volume, detailed monitoring, no key pair."""

from __future__ import annotations

from aws_cdk import aws_ec2 as ec2
from constructs import Construct

ROOT_DEVICE = "/dev/sda1"  # the Ubuntu Deep Learning AMIs' root device


class ServerInstance(Construct):
    def __init__(self, scope: Construct, id: str, *, image_id: str, instance_type: str, subnet_id: str,
                 security_group_id: str, instance_profile: str, root_volume_gib: int | float, user_data: str) -> None:
        super().__init__(scope, id)
        self.instance = ec2.CfnInstance(
            self, "Instance",
            image_id=image_id,
            instance_type=instance_type,
            subnet_id=subnet_id,
            security_group_ids=[security_group_id],
            iam_instance_profile=instance_profile,
            user_data=user_data,
            monitoring=True,
            metadata_options=ec2.CfnInstance.MetadataOptionsProperty(
                http_tokens="required", http_endpoint="enabled", http_put_response_hop_limit=1),
            block_device_mappings=[ec2.CfnInstance.BlockDeviceMappingProperty(
                device_name=ROOT_DEVICE,
                ebs=ec2.CfnInstance.EbsProperty(volume_size=root_volume_gib, volume_type="gp3",
                                                encrypted=True, delete_on_termination=True))],
            tags=[{"key": "Name", "value": "s4kv-server"}],
        )
