"""Exports the raw CloudFormation templates under deploy/ (no CDK bootstrap parameter, rule or metadata).

    python tools/export_templates.py                 # write deploy/*.yaml
    python tools/export_templates.py --check         # exit 1 if deploy/ differs from a fresh export
    python tools/export_templates.py -c modelId=meta-llama/Llama-3.1-8B-Instruct -c instanceType=g6e.xlarge

Writes cfn-gpu-serving.yaml (DLAMI flavour), cfn-gpu-serving-marketplace.yaml (ImageId parameter) and
cfn-ami-bakery.yaml (Image Builder pipeline of the marketplace AMI). cdk-nag runs as in ``cdk synth``.
Every template is region-agnostic: deploy it in any region, or as a StackSet.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEPLOY_DIR = REPO / "deploy"
TEMPLATES = {  # file -> (stack name, flavour or None for the bakery)
    "cfn-gpu-serving.yaml": ("S4kvServing", "dlami"),
    "cfn-gpu-serving-marketplace.yaml": ("S4kvServingMarketplace", "marketplace"),
    "cfn-ami-bakery.yaml": ("S4kvAmiBakery", None),
}


def _yaml_dump(template: dict) -> str:
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def string(dumper, value: str):
        style = "|" if "\n" in value else None  # scripts stay readable as block literals
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Dumper.add_representer(str, string)
    return yaml.dump(template, Dumper=Dumper, sort_keys=False, width=120, allow_unicode=True)


def build_export_app(context: dict | None = None, outdir: str | None = None):
    """The app of the exported stacks (cdk-nag included), not yet synthesized."""
    os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")
    sys.path.insert(0, str(REPO))
    from constructs_lib.settings import DeploySettings
    from stacks.ami_stack import AmiBakeryStack
    from stacks.app_builder import new_app, synthesizer
    from stacks.nag import add_nag
    from stacks.serving_stack import GpuServingStack

    app = new_app(context=context, outdir=outdir)
    # An export never carries the caller's CIDR as a default, nor a region list.
    settings = replace(DeploySettings.from_context(app.node), allowed_cidr=None, regions=())
    for name, flavour in TEMPLATES.values():
        if flavour is None:
            AmiBakeryStack(app, name, settings=settings, artifacts_from="parameters", synthesizer=synthesizer())
        else:
            GpuServingStack(app, name, settings=replace(settings, flavour=flavour), artifacts_from="parameters",
                            synthesizer=synthesizer())
    add_nag(app)
    return app


def templates_from(assembly) -> dict[str, str]:
    """File name -> YAML text of every exported template of a synthesized export app."""
    return {file: _yaml_dump(assembly.get_stack_by_name(name).template) for file, (name, _) in TEMPLATES.items()}


def export(context: dict | None = None) -> dict[str, str]:
    with tempfile.TemporaryDirectory() as outdir:
        return templates_from(build_export_app(context, outdir).synth())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--context", action="append", default=[], metavar="KEY=VALUE",
                        help="CDK context, as for cdk synth (modelId, instanceType, scheme, maxModelLen, "
                             "hfTokenSecretArn, modelConfig)")
    parser.add_argument("--check", action="store_true", help="compare with deploy/ instead of writing")
    parser.add_argument("--out", type=Path, default=DEPLOY_DIR)
    args = parser.parse_args(argv)
    context = dict(item.split("=", 1) for item in args.context)
    templates = export(context)
    stale = [f for f, text in templates.items() if not (args.out / f).is_file() or (args.out / f).read_text() != text]
    if args.check:
        print("deploy/ is up to date" if not stale else f"stale: {', '.join(stale)} (run tools/export_templates.py)")
        return 1 if stale else 0
    args.out.mkdir(parents=True, exist_ok=True)
    for file, text in templates.items():
        (args.out / file).write_text(text)
        print(f"wrote {args.out / file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
