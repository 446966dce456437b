"""cdk-nag 3.x wiring: the AwsSolutions pack as a CDK validation plugin, and acknowledgements with reasons."""

from __future__ import annotations

from aws_cdk import Acknowledgment, App, Validations
from cdk_nag import AwsSolutionsChecks
from constructs import IConstruct


def add_nag(app: App) -> None:
    """Synthesis fails on any unacknowledged finding (cdk-nag reports them as validation errors)."""
    Validations.of(app).add_plugins(AwsSolutionsChecks(app))


def acknowledge(construct: IConstruct, *rules: tuple[str, str]) -> None:
    """``rules``: (rule id, reason) pairs; a reason is mandatory."""
    for rule, reason in rules:
        if not reason.strip():
            raise ValueError(f"acknowledging {rule} needs a reason")
    Validations.of(construct).acknowledge(*(Acknowledgment(id=rule, reason=reason) for rule, reason in rules))
