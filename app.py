#!/usr/bin/env python3
"""CDK app of the S4 KV deployment.

    npx cdk synth -c modelId=Qwen/Qwen2.5-7B-Instruct -c instanceType=g6.xlarge
    npx cdk deploy -c modelId=Qwen/Qwen2.5-7B-Instruct --parameters AllowedCidr=203.0.113.7/32
    npx cdk deploy --all -c regions=us-east-1,us-west-2 --parameters AllowedCidr=203.0.113.7/32
    npx cdk deploy -c amiBakery=true          # Image Builder pipeline of the marketplace AMI

Context keys: constructs_lib/settings.py. cdk-nag's AwsSolutions pack runs on every synth.
"""

from aws_cdk import App

from constructs_lib.settings import DeploySettings
from stacks.app_builder import add_bakery_stack, add_serving_stacks, new_app
from stacks.nag import add_nag

app: App = new_app()
settings = DeploySettings.from_context(app.node)
if app.node.try_get_context("amiBakery") in (True, "true"):
    add_bakery_stack(app, settings)  # the marketplace AMI's Image Builder pipeline, alone
else:
    add_serving_stacks(app, settings)
add_nag(app)
app.synth()
