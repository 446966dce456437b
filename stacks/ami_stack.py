"""Baked-AMI stack (``-c amiBakery=true``): the Image Builder pipeline of the marketplace AMI."""

from __future__ import annotations

from aws_cdk import CfnOutput, CfnParameter, Fn, Stack
from constructs import Construct

from constructs_lib.image_recipe import S4kvImagePipeline
from constructs_lib.runtime_artifacts import CUDA_LOCK, RuntimeArtifacts, build_wheel
from constructs_lib.settings import DeploySettings
from stacks.nag import acknowledge
from stacks.serving_stack import DLAMI_SSM_PARAMETER


class AmiBakeryStack(Stack):
    def __init__(self, scope: Construct, id: str, *, settings: DeploySettings, artifacts_from: str = "assets",
                 **kwargs) -> None:
        """``artifacts_from``: ``assets`` (``cdk deploy``) or ``parameters`` (the exported template)."""
        super().__init__(scope, id, **kwargs)
        self.template_options.description = (
            "S4 KV: EC2 Image Builder pipeline that bakes the server AMI (Deep Learning AMI + vLLM 0.26.0 + s4kv)")
        parent = CfnParameter(self, "DeepLearningAmi", type="AWS::SSM::Parameter::Value<AWS::EC2::Image::Id>",
                              default=DLAMI_SSM_PARAMETER, description="Public SSM parameter of the parent AMI")
        build_type = CfnParameter(self, "BuildInstanceType", type="String", default="g6.xlarge",
                                  description="Instance type of the build (a GPU type the DLAMI supports)")
        artifacts = (RuntimeArtifacts.from_parameters(self) if artifacts_from == "parameters" else
                     RuntimeArtifacts.from_assets(self, build_wheel(), CUDA_LOCK))
        images = S4kvImagePipeline(self, "Ami", parent_image=parent.value_as_string,
                                   build_instance_type=build_type.value_as_string, artifacts=artifacts,
                                   regions=settings.regions)
        CfnOutput(self, "PipelineArn", value=images.pipeline.attr_arn)
        CfnOutput(self, "StartBuildCommand", value=Fn.join("", [
            "aws imagebuilder start-image-pipeline-execution --region ", self.region,
            " --image-pipeline-arn ", images.pipeline.attr_arn]))
        acknowledge(images.role, (
            "AwsSolutions::AwsSolutions-IAM4[Policy::arn:<AWS::Partition>:iam::aws:policy/EC2InstanceProfileForImageBuilder]",
            "The policy EC2 Image Builder documents for build instances (component download, logging)."), (
            "AwsSolutions::AwsSolutions-IAM4[Policy::arn:<AWS::Partition>:iam::aws:policy/AmazonSSMManagedInstanceCore]",
            "Image Builder drives its build instance through Systems Manager; this is its documented policy."))
