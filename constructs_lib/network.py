"""A one-subnet public network for the server and its security group: port 8000 from one CIDR, no SSH.

L1 resources, so that the subnet's zone can come from the template (GPU types are not offered in every zone)
and the template stays region-agnostic for StackSets: either a zone name the user gives, or an availability-zone
ID (the same physical zone in every account) that offers the instance type.
"""

from __future__ import annotations

from aws_cdk import aws_ec2 as ec2, aws_iam as iam, aws_logs as logs
from constructs import Construct

VPC_CIDR = "10.42.0.0/16"
SUBNET_CIDR = "10.42.0.0/20"


class ServingNetwork(Construct):
    """VPC with flow logs, one public subnet in ``availability_zone``, and the server's security group."""

    def __init__(self, scope: Construct, id: str, *, availability_zone: str, availability_zone_id: str,
                 allowed_cidr: str, port: int) -> None:
        """``availability_zone`` / ``availability_zone_id``: tokens of which one resolves to AWS::NoValue."""
        super().__init__(scope, id)
        self.vpc = ec2.CfnVPC(self, "Vpc", cidr_block=VPC_CIDR, enable_dns_hostnames=True, enable_dns_support=True)
        gateway = ec2.CfnInternetGateway(self, "InternetGateway")
        attachment = ec2.CfnVPCGatewayAttachment(self, "GatewayAttachment", vpc_id=self.vpc.ref,
                                                 internet_gateway_id=gateway.ref)
        self.subnet = ec2.CfnSubnet(self, "PublicSubnet", vpc_id=self.vpc.ref, cidr_block=SUBNET_CIDR,
                                    availability_zone=availability_zone, availability_zone_id=availability_zone_id,
                                    map_public_ip_on_launch=True)
        routes = ec2.CfnRouteTable(self, "RouteTable", vpc_id=self.vpc.ref)
        default_route = ec2.CfnRoute(self, "DefaultRoute", route_table_id=routes.ref,
                                     destination_cidr_block="0.0.0.0/0", gateway_id=gateway.ref)
        default_route.add_resource_dependency(attachment)
        ec2.CfnSubnetRouteTableAssociation(self, "RouteTableAssociation", subnet_id=self.subnet.ref,
                                           route_table_id=routes.ref)
        self._flow_logs()
        self.security_group = ec2.CfnSecurityGroup(
            self, "ServerSecurityGroup",
            group_description=f"S4 KV server: TCP {port} from the allowed CIDR only; no SSH",
            vpc_id=self.vpc.ref,
            security_group_ingress=[ec2.CfnSecurityGroup.IngressProperty(
                ip_protocol="tcp", from_port=port, to_port=port, cidr_ip=allowed_cidr,
                description="OpenAI-compatible API and /health")],
            # Outbound: HTTPS (pip, model download, AWS APIs) and HTTP (apt) only.
            security_group_egress=[
                ec2.CfnSecurityGroup.EgressProperty(ip_protocol="tcp", from_port=443, to_port=443,
                                                    cidr_ip="0.0.0.0/0", description="HTTPS out"),
                ec2.CfnSecurityGroup.EgressProperty(ip_protocol="tcp", from_port=80, to_port=80,
                                                    cidr_ip="0.0.0.0/0", description="HTTP out (apt)"),
            ],
        )
        self.dependable = attachment

    def _flow_logs(self) -> None:
        group = logs.CfnLogGroup(self, "FlowLogGroup", retention_in_days=30)
        role = iam.CfnRole(
            self, "FlowLogRole",
            assume_role_policy_document={"Version": "2012-10-17", "Statement": [{
                "Effect": "Allow", "Action": "sts:AssumeRole",
                "Principal": {"Service": "vpc-flow-logs.amazonaws.com"}}]},
            policies=[iam.CfnRole.PolicyProperty(policy_name="WriteFlowLogs", policy_document={
                "Version": "2012-10-17", "Statement": [{
                    "Effect": "Allow",
                    "Action": ["logs:CreateLogStream", "logs:PutLogEvents", "logs:DescribeLogStreams"],
                    # A log group's Arn attribute ends in ":*", which covers its streams.
                    "Resource": group.attr_arn}]})],
        )
        self.flow_log_role = role
        ec2.CfnFlowLog(self, "FlowLog", resource_id=self.vpc.ref, resource_type="VPC", traffic_type="ALL",
                       log_destination_type="cloud-watch-logs", log_group_name=group.ref,
                       deliver_logs_permission_arn=role.attr_arn)
