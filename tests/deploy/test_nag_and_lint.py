"""cdk-nag (AwsSolutions) has no unacknowledged finding and every acknowledgement says why; cfn-lint is
clean on every exported template in every target region."""

from __future__ import annotations

import pytest

LINT_REGIONS = ["us-east-1", "us-east-2", "us-west-2", "eu-central-1", "eu-west-2", "ap-northeast-1"]


def test_cdk_nag_aws_solutions_has_no_unacknowledged_finding(synthesis):
    reports = {r["pluginName"]: r for r in synthesis.validation_report()["pluginReports"]}
    nag = reports["AwsSolutions"]
    assert nag["conclusion"] == "success"
    assert nag["violations"] == []
    acknowledged = nag["suppressedViolations"]
    assert {v["ruleName"] for v in acknowledged} >= {"AwsSolutions-EC29", "AwsSolutions-SMG4"}
    # Every acknowledgement the stacks make matches a finding: none is stale.
    assert {v["ruleName"] for v in acknowledged} == {
        "AwsSolutions-EC23", "AwsSolutions-EC29", "AwsSolutions-IAM5[Resource::*]", "AwsSolutions-SMG4",
        "AwsSolutions-IAM4[Policy::arn:<AWS::Partition>:iam::aws:policy/AmazonSSMManagedInstanceCore]",
        "AwsSolutions-IAM4[Policy::arn:<AWS::Partition>:iam::aws:policy/EC2InstanceProfileForImageBuilder]"}
    for violation in acknowledged + reports["CloudFormation Validate"]["suppressedViolations"]:
        assert len(violation["reason"].split()) >= 8, f"{violation['ruleName']}: acknowledgement without a real reason"


def test_acknowledging_needs_a_reason():
    from aws_cdk import App, Stack
    from stacks.nag import acknowledge

    with pytest.raises(ValueError, match="needs a reason"):
        acknowledge(Stack(App(), "S"), ("AwsSolutions::AwsSolutions-EC29", " "))


def test_cfn_lint_clean_in_every_target_region(synthesis):
    from cfnlint.api import ManualArgs, lint

    for name, text in synthesis.exported.items():
        matches = lint(text, config=ManualArgs(regions=LINT_REGIONS))
        assert not matches, f"{name}:\n" + "\n".join(str(m) for m in matches)
