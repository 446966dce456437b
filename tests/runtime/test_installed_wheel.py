"""The wheel works installed: built from this checkout, installed into an empty folder, and run from a folder
outside the checkout, `s4kv` finds its code, its bundled models and its held-out text inside the installation.

The wheel's own dependencies come from this environment (torch, transformers for `s4kv eval`); the installation
folder is first on PYTHONPATH, so every s4kv module is the installed copy, which each test asserts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SMALL_EVAL = ["--short-windows", "2", "--short-len", "48", "--short-prompts", "2", "--short-prompt-len", "8",
              "--short-generate", "4", "--long-windows", "1", "--long-len", "160", "--long-prompts", "1",
              "--long-generate", "6", "--top-k", "5"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The folder the wheel was installed into (pip install --target, no dependencies)."""
    work = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(work / "dist"), str(REPO)],
                   check=True, cwd=work, capture_output=True, text=True, timeout=600)
    [wheel] = (work / "dist").glob("s4kv-*.whl")
    site = work / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, text=True, timeout=300)
    return site


def run_installed(site: Path, cwd: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_wheel_holds_the_code_models_and_heldout_text(installed, tmp_path):
    code = (
        "import json, os, s4kv.runtime, s4kv.kernels.layout\n"
        "from s4kv.runtime import bundled_models as b\n"
        "print(json.dumps({'runtime': s4kv.runtime.__file__, 'kernels': s4kv.kernels.layout.__file__,\n"
        "  'models': {n: os.path.isfile(os.path.join(b.bundled_model_dir(n), 'config.json'))\n"
        "             for n in (b.QWEN2, b.LLAMA3, *b.REFERENCE_MODELS)},\n"
        "  'model_dir': b.bundled_model_dir(), 'heldout': str(b.HELDOUT), 'heldout_ok': b.HELDOUT.is_file()}))\n"
    )
    result = run_installed(installed, tmp_path, "-c", code)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    for key in ("runtime", "kernels", "model_dir", "heldout"):
        assert Path(found[key]).resolve().is_relative_to(installed.resolve()), (key, found[key])
    assert all(found["models"].values()), found["models"]
    assert found["heldout_ok"]
    assert not (installed / "tools").exists(), "development tools must stay out of the wheel"


def test_eval_runs_from_the_wheel_on_its_bundled_model_and_text(installed, tmp_path):
    result = run_installed(installed, tmp_path, "-m", "s4kv.runtime.cli", "eval", "s4kv-ref-qwen2", "--engine",
                           "torch", "--formats", "s4kv_kivi", "--out-dir", str(tmp_path / "out"), *SMALL_EVAL)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((tmp_path / "out" / "s4kv-ref-qwen2-torch.json").read_text())
    assert Path(record["model"]).resolve().is_relative_to(installed.resolve())
    assert list(record["formats"]) == ["bf16_fa3", "s4kv_kivi"]
    assert record["formats"]["bf16_fa3"]["short"]["mean_kl"] == 0.0
    assert record["formats"]["s4kv_kivi"]["short"]["mean_kl"] > 0.0
