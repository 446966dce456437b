"""The CDK context is validated before anything is synthesized, with errors that name the fix."""

from __future__ import annotations

import pytest

import deploy_support  # noqa: F401  (puts the app's packages on sys.path)

pytest.importorskip("aws_cdk")

from aws_cdk import App  # noqa: E402
from constructs_lib.settings import DeploySettings  # noqa: E402


def test_model_config_sizes_a_model_the_app_does_not_know():
    from constructs_lib import serving_plan
    from deploy_support import REPO

    settings = DeploySettings.from_context(App(context={
        "modelId": "my-org/my-qwen-finetune", "modelConfig": str(REPO / "configs" / "qwen2.5-7b-instruct.json")}).node)
    assert settings.model_source.endswith("qwen2.5-7b-instruct.json")
    plans = serving_plan.plans_for(settings.model_source, settings.max_model_len)
    assert serving_plan.mapping(plans) == serving_plan.mapping(
        serving_plan.plans_for("Qwen/Qwen2.5-7B-Instruct", settings.max_model_len))


def test_context_is_read_with_defaults_and_region_list():
    settings = DeploySettings.from_context(App(context={"regions": "us-east-1, us-west-2", "scheme": "int4_saw"}).node)
    assert settings.regions == ("us-east-1", "us-west-2")
    assert settings.scheme == "int4_saw" and settings.model_id == "Qwen/Qwen2.5-7B-Instruct"
    assert settings.allowed_cidr is None and settings.flavour == "dlami"


@pytest.mark.parametrize("context, message", [
    ({"allowedCidr": "1.2.3.4"}, "203.0.113.7/32"),
    ({"allowedCidr": "10.0.0.1/8"}, "host bits"),
    ({"scheme": "int8"}, "int4_kivi"),
    ({"flavour": "docker"}, "marketplace"),
    ({"instanceType": "g7.huge"}, "g6.xlarge"),
    ({"maxModelLen": "0"}, "positive"),
    ({"modelId": "configs/qwen2.5-7b-instruct.json"}, "modelConfig"),
    ({"modelId": "Qwen/Qwen 2.5'; rm -rf /"}, "Hugging Face model id"),
    ({"modelId": "meta-llama/Llama-3.1-8B-Instruct"}, "gated on Hugging Face.*hfTokenSecretArn"),
    ({"hfTokenSecretArn": "my-token"}, "Secrets Manager secret ARN"),
])
def test_bad_context_fails_with_a_clear_message(context, message):
    with pytest.raises(ValueError, match=message):
        DeploySettings.from_context(App(context=context).node)


def test_gated_model_with_a_token_makes_the_token_parameter_required():
    from stacks.app_builder import new_app
    from stacks.serving_stack import GpuServingStack

    arn = "arn:aws:secretsmanager:us-east-1:123456789012:secret:hf-token-AbCdEf"
    app = new_app()
    settings = DeploySettings(model_id="meta-llama/Llama-3.1-8B-Instruct", instance_type="g6e.xlarge",
                              hf_token_secret_arn=arn)
    stack = GpuServingStack(app, "Gated", settings=settings, artifacts_from="parameters")
    parameter = app.synth().get_stack_by_name(stack.stack_name).template["Parameters"]["HfTokenSecretArn"]
    assert parameter["Default"] == arn and not parameter["AllowedPattern"].endswith(")?$"), "a token is required"

