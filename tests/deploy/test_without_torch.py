"""The CDK app and `s4kv capacity` run where torch, triton, numpy and vLLM are not installed.

Each check runs in a fresh interpreter whose import system refuses those packages (a meta-path finder placed
first), so an import of any of them, direct or through another module, fails the run the way a missing package
would on a machine that installed only requirements.txt."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from deploy_support import REPO

BLOCKED = ("torch", "triton", "numpy", "vllm", "transformers")
BLOCKER = f"""
import importlib.abc, sys
class RefuseHeavyPackages(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {BLOCKED!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked: the CDK side must not need it)", name=name)
        return None
sys.meta_path.insert(0, RefuseHeavyPackages())
"""


def run_blocked(code: str, env: dict[str, str] | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKER + code], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_the_blocker_refuses_torch():
    result = run_blocked("import torch")
    assert result.returncode != 0 and "blocked: the CDK side must not need it" in result.stderr


def test_cdk_app_synthesizes_without_torch(tmp_path: Path):
    # What `npx cdk synth` does: run app.py with cdk.json's context and an output folder in the environment.
    context = json.loads((REPO / "cdk.json").read_text())["context"]
    result = run_blocked(
        "import runpy, sys\n"
        "runpy.run_path('app.py', run_name='__main__')\n"
        f"assert not {{m for m in sys.modules if m.partition('.')[0] in {BLOCKED!r}}}\n",
        env={"CDK_OUTDIR": str(tmp_path), "CDK_CONTEXT_JSON": json.dumps(context),
             "JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION": "20"})
    assert result.returncode == 0, result.stderr[-4000:]
    templates = sorted(p.name for p in tmp_path.glob("*.template.json"))
    assert templates, f"no template in {tmp_path}: {sorted(p.name for p in tmp_path.iterdir())}"
    resources = json.loads((tmp_path / templates[0]).read_text())["Resources"]
    assert any(r["Type"] == "AWS::EC2::Instance" for r in resources.values())


def test_capacity_command_without_torch():
    result = run_blocked(
        "from s4kv.runtime.cli import main\n"
        "raise SystemExit(main(['capacity', '--model', 'Qwen/Qwen2.5-7B-Instruct', '--instance', 'g6.xlarge',"
        " '--context', '8192']))\n", timeout=120)
    assert result.returncode == 0, result.stderr
    assert "tensor parallel 1, data parallel 1" in result.stdout
