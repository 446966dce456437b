"""The server instance's IAM role and instance profile, least privilege.

Exactly three things: Session Manager (no SSH), writing its own CloudWatch log group, and reading its
own API-key secret. No managed policies.
"""

from __future__ import annotations

from aws_cdk import aws_iam as iam
from constructs import Construct

# The Session Manager actions an instance needs (AWS docs: "Create a custom IAM role for Session Manager").
# None of them supports resource-level permissions, hence Resource "*".
SESSION_MANAGER_ACTIONS = [
    "ssm:UpdateInstanceInformation",
    "ssmmessages:CreateControlChannel",
    "ssmmessages:CreateDataChannel",
    "ssmmessages:OpenControlChannel",
    "ssmmessages:OpenDataChannel",
]
LOG_ACTIONS = ["logs:CreateLogStream", "logs:PutLogEvents", "logs:DescribeLogStreams"]


class ServerRole(Construct):
    def __init__(self, scope: Construct, id: str, *, log_group_arn: str, api_key_secret_arn: str) -> None:
        super().__init__(scope, id)
        statements = [
            {"Sid": "SessionManager", "Effect": "Allow", "Action": SESSION_MANAGER_ACTIONS, "Resource": "*"},
            # The Arn attribute of a log group ends in ":*": its streams, nothing else.
            {"Sid": "OwnLogGroup", "Effect": "Allow", "Action": LOG_ACTIONS, "Resource": log_group_arn},
            {"Sid": "OwnApiKey", "Effect": "Allow", "Action": "secretsmanager:GetSecretValue",
             "Resource": api_key_secret_arn},
        ]
        self.role = iam.CfnRole(
            self, "Role",
            description="S4 KV server: Session Manager, its own log group, its own API-key secret",
            assume_role_policy_document={"Version": "2012-10-17", "Statement": [{
                "Effect": "Allow", "Action": "sts:AssumeRole", "Principal": {"Service": "ec2.amazonaws.com"}}]},
            policies=[iam.CfnRole.PolicyProperty(
                policy_name="S4kvServer", policy_document={"Version": "2012-10-17", "Statement": statements})],
        )
        self.instance_profile = iam.CfnInstanceProfile(self, "InstanceProfile", roles=[self.role.ref])
