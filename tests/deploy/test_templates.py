"""Security and wiring properties of the synthesized templates (aws_cdk.assertions over the session's
one synthesis), and the committed deploy/*.yaml being exactly a fresh export."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import yaml
from aws_cdk.assertions import Template

from constructs_lib.serving_plan import ARGS_KEYS
from deploy_support import REGIONS, REPO

SERVING = ("S4kvServing", "S4kvServingMarketplace")


@pytest.fixture(scope="module", params=SERVING)
def serving(request, synthesis):
    return request.param, synthesis.template(request.param)


def _only(template: dict, resource_type: str) -> dict:
    found = [r for r in template["Resources"].values() if r["Type"] == resource_type]
    assert len(found) == 1, f"expected one {resource_type}, found {len(found)}"
    return found[0]["Properties"]


def _user_data_parts(template: dict) -> list:
    return _only(template, "AWS::EC2::LaunchTemplate")["LaunchTemplateData"]["UserData"]["Fn::Base64"]["Fn::Join"][1]


def _user_data_text(template: dict) -> str:
    """All literal text of the instance's user data (the Fn::Sub template and the static parts)."""
    return "".join(part if isinstance(part, str) else part["Fn::Sub"][0] for part in _user_data_parts(template))


EC2_USER_DATA_LIMIT = 16384  # bytes before base64: EC2 refuses a launch template whose user data is larger
SUBSTITUTED_RESERVE = 2048  # what the parameter values (model id, ARNs, flags up to ExtraVllmArgs' 512, hashes) add


def test_the_user_data_fits_ec2s_limit_with_room_for_the_parameters(serving):
    name, template = serving
    size = len(_user_data_text(template).encode())
    assert size <= EC2_USER_DATA_LIMIT - SUBSTITUTED_RESERVE, f"{name}: {size} bytes of user data before substitution"
    extra = template["Parameters"]["ExtraVllmArgs"]
    assert extra["MaxLength"] == 512


def _user_data_variables(template: dict) -> dict:
    return next(part["Fn::Sub"][1] for part in _user_data_parts(template) if isinstance(part, dict))


def test_security_group_allows_only_port_8000_from_the_cidr_parameter(serving):
    name, template = serving
    assertions = Template.from_json(template)
    assertions.resource_count_is("AWS::EC2::SecurityGroup", 1)
    assertions.resource_count_is("AWS::EC2::SecurityGroupIngress", 0)
    ingress = _only(template, "AWS::EC2::SecurityGroup")["SecurityGroupIngress"]
    assert [{k: v for k, v in rule.items() if k != "Description"} for rule in ingress] == [
        {"CidrIp": {"Ref": "AllowedCidr"}, "FromPort": 8000, "IpProtocol": "tcp", "ToPort": 8000}]
    assert "Default" not in template["Parameters"]["AllowedCidr"], "the CIDR must have no default"
    egress = _only(template, "AWS::EC2::SecurityGroup")["SecurityGroupEgress"]
    egress_ports = sorted(rule["FromPort"] for rule in egress)
    assert egress_ports == [80, 443]


def test_no_ssh_no_key_pair(serving):
    _, template = serving
    instance = _only(template, "AWS::EC2::Instance")
    assert "KeyName" not in instance
    assert all(p.get("Type") != "AWS::EC2::KeyPair::KeyName" for p in template["Parameters"].values())
    assert "22" not in json.dumps(_only(template, "AWS::EC2::SecurityGroup")["SecurityGroupIngress"])


def test_imdsv2_required_and_root_volume_encrypted_gp3_sized_by_parameter(serving):
    _, template = serving
    Template.from_json(template).has_resource_properties("AWS::EC2::Instance", {
        "MetadataOptions": {"HttpTokens": "required", "HttpEndpoint": "enabled", "HttpPutResponseHopLimit": 1},
        "BlockDeviceMappings": [{"DeviceName": "/dev/sda1", "Ebs": {
            "Encrypted": True, "VolumeType": "gp3", "VolumeSize": {"Ref": "RootVolumeGiB"},
            "DeleteOnTermination": True}}],
        "Monitoring": True,
    })


def test_instance_role_is_least_privilege(serving):
    name, template = serving
    roles = {k: r["Properties"] for k, r in template["Resources"].items() if r["Type"] == "AWS::IAM::Role"}
    server = next(p for p in roles.values() if "ec2.amazonaws.com" in json.dumps(p["AssumeRolePolicyDocument"]))
    assert "ManagedPolicyArns" not in server
    [policy] = server["Policies"]
    statements = {s["Sid"]: s for s in policy["PolicyDocument"]["Statement"]}
    base = {"SessionManager", "OwnLogGroup", "OwnSecrets", "SignalOwnStack", "PublishS4kvMetrics"}
    assert set(statements) == (base if name == "S4kvServingMarketplace" else base | {"RuntimeArtifacts"})
    assert all(s["Effect"] == "Allow" for s in statements.values())
    session = statements["SessionManager"]
    assert session["Resource"] == "*" and all(a.startswith(("ssm:UpdateInstanceInformation", "ssmmessages:"))
                                               for a in session["Action"])
    assert statements["OwnLogGroup"]["Resource"] == {"Fn::GetAtt": ["ServerLogs", "Arn"]}
    assert statements["OwnSecrets"]["Action"] == "secretsmanager:GetSecretValue"
    secret_logical = next(k for k, r in template["Resources"].items() if r["Type"] == "AWS::SecretsManager::Secret")
    api_key, hf_token = statements["OwnSecrets"]["Resource"]
    assert api_key["Fn::If"][1:] == [{"Ref": secret_logical}, {"Ref": "ApiKeySecretArn"}]
    assert hf_token == {"Fn::If": ["HasHfToken", {"Ref": "HfTokenSecretArn"}, {"Ref": "AWS::NoValue"}]}
    assert statements["PublishS4kvMetrics"]["Action"] == "cloudwatch:PutMetricData"
    assert statements["PublishS4kvMetrics"]["Condition"] == {"StringEquals": {"cloudwatch:namespace": "S4KV"}}
    assert statements["SignalOwnStack"] == {"Sid": "SignalOwnStack", "Effect": "Allow",
                                            "Action": "cloudformation:SignalResource",
                                            "Resource": {"Ref": "AWS::StackId"}}
    all_actions = json.dumps([s["Action"] for s in statements.values()])
    assert "*\"" not in all_actions.replace("ssmmessages:", ""), "no wildcard actions"


def test_api_key_is_generated_into_secrets_manager_and_never_in_template_or_user_data(serving):
    _, template = serving
    secret = next(r for r in template["Resources"].values() if r["Type"] == "AWS::SecretsManager::Secret")
    assert secret["Condition"].startswith("ApiKeyGenerateApiKey")
    assert "SecretString" not in secret["Properties"]
    assert secret["Properties"]["GenerateSecretString"]["PasswordLength"] >= 32
    user_data = _user_data_text(template)
    # Read only with `aws secretsmanager get-secret-value --query SecretString` (launcher, readiness check, metrics).
    assert "--api-key" not in user_data and "SecretString" not in user_data.replace(
        "--query SecretString", "").replace('"--query", "SecretString"', ""), "the key is only ever read at run time"
    if "start-server" in user_data and "#!/bin/bash\n# Starts the S4 KV server" in user_data:
        # The only place the key exists on the instance: the launcher's environment, from Secrets Manager.
        assert 'VLLM_API_KEY="$(aws secretsmanager get-secret-value' in user_data
    outputs = template["Outputs"]
    assert "get-secret-value" in json.dumps(outputs["GetApiKeyCommand"])


def test_user_data_installs_the_locked_runtime_from_s3_and_starts_s4kv_serve(synthesis):
    dlami = _user_data_text(synthesis.template("S4kvServing"))
    marketplace = _user_data_text(synthesis.template("S4kvServingMarketplace"))
    assert "--require-hashes --no-deps" in dlami and 'sha256sum --check' in dlami
    assert "pip install" not in marketplace and "S4KV_ARTIFACT_BUCKET" not in marketplace, "the AMI has it all"
    for text in (dlami, marketplace):
        assert "systemctl enable --now s4kv.service" in text
        # Logs go to CloudWatch before anything is installed; the signal trap is armed before both.
        assert text.index("trap s4kv_on_exit EXIT") < text.index("-a fetch-config")
        first_install_or_start = "--require-hashes" if "--require-hashes" in text else "systemctl enable"
        assert text.index("-a fetch-config") < text.index(first_install_or_start)
        assert text.index("/v1/completions") < text.index("s4kv_signal SUCCESS")
    variables = _user_data_variables(synthesis.template("S4kvServing"))
    assert variables["ModelId"] == "Qwen/Qwen2.5-7B-Instruct" and variables["SignalResource"] == "ServerInstance"
    assert {k: variables[k] for k in ("ArtifactBucket", "WheelKey", "WheelSha256", "LockKey", "LockSha256")} == {
        k: {"Ref": k} for k in ("ArtifactBucket", "WheelKey", "WheelSha256", "LockKey", "LockSha256")}
    exported = synthesis.template("S4kvServing")["Parameters"]
    artifact_parameters = ("ArtifactBucket", "WheelKey", "WheelSha256", "LockKey", "LockSha256")
    assert all("Default" not in exported[k] for k in artifact_parameters)


def test_cdk_app_ships_the_wheel_and_lock_as_assets_and_reads_exactly_them(synthesis):
    from constructs_lib.runtime_artifacts import CUDA_LOCK, sha256

    template = synthesis.template("S4kvServing-us-east-1")
    variables = _user_data_variables(template)
    assert variables["LockSha256"] == sha256(CUDA_LOCK) and len(variables["WheelSha256"]) == 64
    assert variables["WheelName"] == "s4kv-0.1.0-py3-none-any.whl"
    assert variables["WheelKey"].endswith(".whl") and variables["LockKey"].endswith(".txt")
    role = next(r["Properties"] for r in template["Resources"].values() if r["Type"] == "AWS::IAM::Role"
                and "ec2.amazonaws.com" in json.dumps(r["Properties"]["AssumeRolePolicyDocument"]))
    [read] = [s for s in role["Policies"][0]["PolicyDocument"]["Statement"] if s["Sid"] == "RuntimeArtifacts"]
    assert read["Action"] == "s3:GetObject"
    keys = sorted(arn["Fn::Sub"][1]["Key"] for arn in read["Resource"])
    assert keys == sorted([variables["WheelKey"], variables["LockKey"]]), "exactly the two objects, no wildcard"
    assembly_assets = {f.name for f in synthesis.outdir.iterdir() if f.name.startswith("asset.")}
    assert f"asset.{variables['WheelKey'].removesuffix('.whl')}.whl" in assembly_assets


def test_settings_changes_replace_the_instance_and_it_waits_for_the_signal(serving):
    _, template = serving
    [(name, instance)] = [(k, r) for k, r in template["Resources"].items() if r["Type"] == "AWS::EC2::Instance"]
    assert name == "ServerInstance"
    launch = _only(template, "AWS::EC2::LaunchTemplate")
    launch_id = next(k for k, r in template["Resources"].items() if r["Type"] == "AWS::EC2::LaunchTemplate")
    assert instance["Properties"]["LaunchTemplate"]["Version"] == {"Fn::GetAtt": [launch_id, "LatestVersionNumber"]}
    assert "UserData" not in instance["Properties"] and "UserData" in launch["LaunchTemplateData"]
    assert instance["CreationPolicy"] == {"ResourceSignal": {"Count": 1, "Timeout": {"Ref": "BootTimeout"}}}
    variables = _user_data_variables(template)
    for setting in ("Scheme", "InstanceType", "ExtraVllmArgs", "HfTokenSecretArn"):
        assert variables[setting] == {"Ref": setting}, f"{setting} must be in the user data, so a change replaces"


def test_user_data_is_valid_bash(serving):
    _, template = serving
    text = _user_data_text(template)
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    if shutil.which("shellcheck"):
        lint = subprocess.run(["shellcheck", "-s", "bash", "-"], input=text, text=True, capture_output=True)
        assert lint.returncode == 0, lint.stdout


def test_dlami_from_public_ssm_parameter_and_marketplace_takes_image_id(synthesis):
    dlami = synthesis.template("S4kvServing")["Parameters"]
    assert dlami["DeepLearningAmi"] == {
        "Type": "AWS::SSM::Parameter::Value<AWS::EC2::Image::Id>",
        "Default": "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-24.04/latest/ami-id",
        "Description": dlami["DeepLearningAmi"]["Description"]}
    market = synthesis.template("S4kvServingMarketplace")["Parameters"]
    assert market["ImageId"]["Type"] == "AWS::EC2::Image::Id" and "Default" not in market["ImageId"]
    assert "DeepLearningAmi" not in market
    assert _only(synthesis.template("S4kvServingMarketplace"), "AWS::EC2::Instance")["ImageId"] == {"Ref": "ImageId"}


def test_outputs_explain_endpoint_key_and_capacity(serving):
    _, template = serving
    assert {"Endpoint", "HealthUrl", "ApiKeySecret", "GetApiKeyCommand", "VllmSettings", "CapacityEstimate",
            "InstanceId", "SessionManagerCommand", "LogGroup"} <= set(template["Outputs"])
    assert ":8000/v1" in json.dumps(template["Outputs"]["Endpoint"])
    assert ":8000/health" in json.dumps(template["Outputs"]["HealthUrl"])


def test_mapping_rows_are_the_capacity_plans(synthesis):
    from s4kv.runtime.sizing import capacity, catalog, model_shapes

    model = model_shapes.load("Qwen/Qwen2.5-7B-Instruct")
    plans = synthesis.template("S4kvServing")["Mappings"]["ServingPlans"]
    assert list(plans) == synthesis.template("S4kvServing")["Parameters"]["InstanceType"]["AllowedValues"]
    for name, row in plans.items():
        for scheme, key in ARGS_KEYS.items():
            assert row[key] == " ".join(capacity.plan(model, catalog.instance_type(name), scheme, 32768).vllm_args())
        kivi = capacity.plan(model, catalog.instance_type(name), "int4_kivi", 32768)
        saw = capacity.plan(model, catalog.instance_type(name), "int4_saw", 32768)
        assert (f"int4_kivi {kivi.for_format('int4').concurrent_requests}, "
                f"int4_saw {saw.for_format('int4').concurrent_requests} concurrent") in row["Capacity"]
        assert kivi.for_format("int4").concurrent_requests <= saw.for_format("int4").concurrent_requests


def test_exported_templates_have_no_cdk_bootstrap_or_metadata(synthesis):
    for name, text in synthesis.exported.items():
        template = yaml.safe_load(text)
        assert "Rules" not in template and "Metadata" not in template, name
        assert "BootstrapVersion" not in template.get("Parameters", {}), name
        assert "CDKMetadata" not in template["Resources"], name
        assert all("Metadata" not in r for r in template["Resources"].values()), name
        assert "aws:cdk" not in text and "cdk-bootstrap" not in text and "hnb659fds" not in text, name


def test_committed_templates_equal_a_fresh_export(synthesis):
    for name, text in synthesis.exported.items():
        committed = (REPO / "deploy" / name).read_text()
        assert committed == text, f"deploy/{name} is stale: run python tools/export_templates.py"


def test_one_stack_per_region(synthesis):
    assert [s.stack_name for s in synthesis.regional_stacks] == [f"S4kvServing-{r}" for r in REGIONS]
    assert [s.region for s in synthesis.regional_stacks] == list(REGIONS)
    regional = synthesis.template("S4kvServing-us-west-2")
    assert regional["Mappings"] == synthesis.template("S4kvServing")["Mappings"]


def test_rollout_refuses_a_region_that_does_not_offer_the_instance_type():
    from constructs_lib.regions import check_offered, offered_regions

    assert "us-east-1" in offered_regions("g6.xlarge")
    check_offered("g6.xlarge", ["us-east-1", "us-west-2"])
    not_offering = next(r for r in ("af-south-1", "eu-west-1", "ap-east-1") if r not in offered_regions("p5e.48xlarge"))
    with pytest.raises(ValueError, match=f"not offered in {not_offering}"):
        check_offered("p5e.48xlarge", ["us-west-2", not_offering])


def test_bakery_recipe_uses_the_same_install_script_and_artifacts(synthesis):
    from constructs_lib.user_data import install_script

    template = synthesis.template("S4kvAmiBakery")
    parts = _only(template, "AWS::ImageBuilder::Component")["Data"]["Fn::Join"][1]
    assert [p for p in parts if isinstance(p, dict)] == [
        {"Ref": k} for k in ("ArtifactBucket", "WheelKey", "WheelSha256", "LockKey", "LockSha256")]
    document = json.loads("".join(p if isinstance(p, str) else "x" for p in parts))
    [install] = document["phases"][0]["steps"][0]["inputs"]["commands"]
    assert install.endswith(install_script())
    role = _only(template, "AWS::IAM::Role")
    [read] = role["Policies"][0]["PolicyDocument"]["Statement"]
    assert read["Action"] == "s3:GetObject" and len(read["Resource"]) == 2
    infra = _only(template, "AWS::ImageBuilder::InfrastructureConfiguration")
    assert infra["InstanceMetadataOptions"]["HttpTokens"] == "required"
    recipe = _only(template, "AWS::ImageBuilder::ImageRecipe")
    assert recipe["ParentImage"] == {"Ref": "DeepLearningAmi"}
    assert recipe["BlockDeviceMappings"][0]["Ebs"]["Encrypted"] is True


def test_subnet_zone_is_one_that_offers_the_instance_type_or_the_named_zone(serving):
    from constructs_lib.regions import zone_ids

    _, template = serving
    subnet = _only(template, "AWS::EC2::Subnet")
    assert subnet["AvailabilityZone"] == {"Fn::If": ["ZoneGiven", {"Ref": "AvailabilityZone"}, {"Ref": "AWS::NoValue"}]}
    assert subnet["AvailabilityZoneId"] == {"Fn::If": ["ZoneGiven", {"Ref": "AWS::NoValue"}, {"Fn::FindInMap": [
        "ZoneIds", {"Ref": "AWS::Region"}, {"Fn::FindInMap": ["ServingPlans", {"Ref": "InstanceType"}, "ZoneKey"]}]}]}
    table, plans = template["Mappings"]["ZoneIds"], template["Mappings"]["ServingPlans"]
    for instance_type in template["Parameters"]["InstanceType"]["AllowedValues"]:
        key, offered = plans[instance_type]["ZoneKey"], zone_ids(instance_type)
        for region, ids in offered.items():
            assert table[region][key] == ids[0]
        assert all(key not in row for region, row in table.items() if region not in offered)
    assert table["us-east-1"]["g6xlarge"] in zone_ids("g6.xlarge")["us-east-1"]
