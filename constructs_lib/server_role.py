"""The server instance's IAM role and instance profile, least privilege.

Exactly these: Session Manager (no SSH), writing its own CloudWatch log group, metrics in the S4KV namespace,
reading its own secrets (the API key, and the Hugging Face token when one is given), reading the two runtime
artifacts (DLAMI flavour), and signalling its own stack. No managed policies.
"""

from __future__ import annotations

from aws_cdk import Aws, aws_iam as iam
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
METRICS_NAMESPACE = "S4KV"  # runtime/publish_metrics.py
LOG_ACTIONS = ["logs:CreateLogStream", "logs:PutLogEvents", "logs:DescribeLogStreams"]


class ServerRole(Construct):
    """``secret_arns``: ARNs (or Fn::If tokens that may resolve to AWS::NoValue) of the secrets it reads;
    ``artifact_statement``: the S3 read of the runtime artifacts, None for a baked AMI."""

    def __init__(self, scope: Construct, id: str, *, log_group_arn: str, secret_arns: list[str],
                 artifact_statement: dict | None) -> None:
        super().__init__(scope, id)
        statements = [
            {"Sid": "SessionManager", "Effect": "Allow", "Action": SESSION_MANAGER_ACTIONS, "Resource": "*"},
            # The Arn attribute of a log group ends in ":*": its streams, nothing else.
            {"Sid": "OwnLogGroup", "Effect": "Allow", "Action": LOG_ACTIONS, "Resource": log_group_arn},
            {"Sid": "OwnSecrets", "Effect": "Allow", "Action": "secretsmanager:GetSecretValue",
             "Resource": secret_arns},
            # runtime/publish_metrics.py; PutMetricData has no resource-level permission, the namespace condition
            # limits it to the S4KV namespace.
            {"Sid": "PublishS4kvMetrics", "Effect": "Allow", "Action": "cloudwatch:PutMetricData", "Resource": "*",
             "Condition": {"StringEquals": {"cloudwatch:namespace": METRICS_NAMESPACE}}},
            # The readiness signal (scripts/signal.sh) of this stack's instance only.
            {"Sid": "SignalOwnStack", "Effect": "Allow", "Action": "cloudformation:SignalResource",
             "Resource": Aws.STACK_ID},
        ]
        if artifact_statement:
            statements.append(artifact_statement)
        self.role = iam.CfnRole(
            self, "Role",
            description="S4 KV server: Session Manager, its log group and metrics, its secrets and runtime artifacts, "
                        "its stack's signal",
            assume_role_policy_document={"Version": "2012-10-17", "Statement": [{
                "Effect": "Allow", "Action": "sts:AssumeRole", "Principal": {"Service": "ec2.amazonaws.com"}}]},
            policies=[iam.CfnRole.PolicyProperty(
                policy_name="S4kvServer", policy_document={"Version": "2012-10-17", "Statement": statements})],
        )
        self.instance_profile = iam.CfnInstanceProfile(self, "InstanceProfile", roles=[self.role.ref])
