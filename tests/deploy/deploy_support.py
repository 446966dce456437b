"""What the deployment tests share: paths, the region set, and the session's one CDK synthesis."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # app.py's packages (constructs_lib, stacks) live at the repo root
sys.path.insert(0, str(REPO / "tools"))
os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")

REGIONS = ("us-east-1", "us-west-2")  # the multi-region set of the tests


class Synthesis:
    """The session's cloud assembly: the three exported stacks plus one stack per region of REGIONS."""

    def __init__(self, outdir: Path) -> None:
        import export_templates
        from constructs_lib.settings import DeploySettings
        from stacks.app_builder import add_serving_stacks

        self.outdir = outdir
        app = export_templates.build_export_app(outdir=str(outdir))
        self.regional_stacks = add_serving_stacks(app, replace(DeploySettings(), regions=REGIONS))
        self.assembly = app.synth()
        self.exported = export_templates.templates_from(self.assembly)

    def template(self, stack_name: str) -> dict:
        return self.assembly.get_stack_by_name(stack_name).template

    def validation_report(self) -> dict:
        return json.loads((self.outdir / "validation-report.json").read_text())
