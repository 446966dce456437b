"""Builds the CDK app from settings: the one place app.py, the template export and the tests share.

Templates carry no CDK bootstrap parameter, rule or metadata (no version reporting, no construct
paths), so the same synthesis is deployable with ``cdk deploy`` and exportable as raw CloudFormation.
"""

from __future__ import annotations

from aws_cdk import App, DefaultStackSynthesizer, Environment

from constructs_lib.regions import check_offered
from constructs_lib.settings import DeploySettings
from stacks.ami_stack import AmiBakeryStack
from stacks.serving_stack import GpuServingStack

CLEAN_TEMPLATE_CONTEXT = {"aws:cdk:enable-path-metadata": False, "aws:cdk:version-reporting": False}
STACK_NAME = "S4kvServing"
BAKERY_STACK_NAME = "S4kvAmiBakery"


def synthesizer() -> DefaultStackSynthesizer:
    return DefaultStackSynthesizer(generate_bootstrap_version_rule=False)


def new_app(context: dict | None = None, outdir: str | None = None) -> App:
    return App(context={**CLEAN_TEMPLATE_CONTEXT, **(context or {})}, analytics_reporting=False, outdir=outdir)


def add_serving_stacks(app: App, settings: DeploySettings) -> list[GpuServingStack]:
    """One env-agnostic stack, or one stack per region of ``settings.regions`` (each checked to offer
    the instance type, from the offline offerings snapshot). The runtime artifacts are CDK assets."""
    if not settings.regions:
        return [GpuServingStack(app, STACK_NAME, settings=settings, synthesizer=synthesizer())]
    check_offered(settings.instance_type, settings.regions)
    return [
        GpuServingStack(app, f"{STACK_NAME}-{region}", settings=settings, synthesizer=synthesizer(),
                        env=Environment(region=region))
        for region in settings.regions
    ]


def add_bakery_stack(app: App, settings: DeploySettings) -> AmiBakeryStack:
    return AmiBakeryStack(app, BAKERY_STACK_NAME, settings=settings, synthesizer=synthesizer())
