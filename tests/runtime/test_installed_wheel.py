"""The wheel works installed: built from this checkout and installed into a fresh virtual environment, then run from a
folder outside the checkout, `s4kv` finds its code, its vLLM plugin entry point, its bundled models and its held-out
text inside that environment; `s4kv eval` and `s4kv demo` (the README's quick start: vLLM's CPU engine behind its
OpenAI server, asked through the openai client) run from it.

The environment's third-party packages (torch, vLLM, transformers, openai) are this environment's, seen through a
folder of links that leaves out every s4kv entry (the editable install's metadata and finder, its .pth files), so
nothing in the fresh environment can reach the checkout's code, models or data: each test asserts where s4kv came
from, and no entry of sys.path or PATH points into the checkout."""

from __future__ import annotations

import json
import os
import site
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from s4kv.runtime.bundled_models import FACTS, QWEN2

REPO = Path(__file__).resolve().parents[2]
SMALL_EVAL = ["--short-windows", "2", "--short-len", "48", "--short-prompts", "2", "--short-prompt-len", "8",
              "--short-generate", "4", "--long-windows", "1", "--long-len", "160", "--long-prompts", "1",
              "--long-generate", "6", "--top-k", "5"]


def third_party_view(folder: Path) -> Path:
    """A folder of links to this environment's installed packages, less s4kv's own entries and every .pth file
    (an editable install maps s4kv into the checkout through one)."""
    folder.mkdir()
    sources = [Path(p) for p in site.getsitepackages() if Path(p).is_dir()]
    for source in sources:
        for entry in source.iterdir():
            name = entry.name.lower()
            if name.startswith(("s4kv", "__editable__", "_s4kv")) or name.endswith(".pth") \
                    or (folder / entry.name).exists():
                continue
            (folder / entry.name).symlink_to(entry)
    return folder


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A fresh virtual environment holding the wheel (no dependencies installed: they come from the linked view)."""
    work = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(work / "dist"), str(REPO)],
                   check=True, cwd=work, capture_output=True, text=True, timeout=600)
    [wheel] = (work / "dist").glob("s4kv-*.whl")
    env_dir = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    purelib = Path(sysconfig.get_path("purelib", vars={"base": str(env_dir), "platbase": str(env_dir)}))
    view = third_party_view(work / "third-party")
    (purelib / "third_party.pth").write_text(f"{view}\n")  # a plain path line: the view's own .pth files stay off
    # this environment's pip installs into the fresh one (which has none): the wheel with its console script
    subprocess.run([sys.executable, "-m", "pip", "--python", str(env_dir / "bin" / "python"), "install", "-q",
                    "--no-deps", "--no-index", str(wheel)], check=True, capture_output=True, text=True, timeout=300)
    return env_dir


def clean_env(venv: Path) -> dict[str, str]:
    """The environment a user of the fresh venv has: its bin first, nothing of the checkout on any path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    kept = [p for p in env.get("PATH", "").split(os.pathsep) if p and not Path(p).resolve().is_relative_to(REPO)
            and not Path(p).resolve().is_relative_to(Path(sys.prefix).resolve())]
    env["PATH"] = os.pathsep.join([str(venv / "bin"), *kept])
    env["VIRTUAL_ENV"] = str(venv)
    return env


def run_installed(venv: Path, cwd: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=clean_env(venv), capture_output=True, text=True, timeout=timeout)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_wheel_holds_the_code_entry_point_models_and_heldout_text(venv, tmp_path):
    code = (
        "import json, os, sys, importlib.metadata as md, s4kv.runtime, s4kv.kernels.layout\n"
        "from s4kv.runtime import bundled_models as b\n"
        "[plugin] = [e for e in md.entry_points(group='vllm.general_plugins') if e.name == 's4kv']\n"
        "print(json.dumps({'runtime': s4kv.runtime.__file__, 'kernels': s4kv.kernels.layout.__file__,\n"
        "  'models': {n: os.path.isfile(os.path.join(b.bundled_model_dir(n), 'config.json'))\n"
        "             for n in (b.QWEN2, b.LLAMA3, *b.REFERENCE_MODELS)},\n"
        "  'model_dir': b.bundled_model_dir(), 'heldout': str(b.HELDOUT), 'heldout_ok': b.HELDOUT.is_file(),\n"
        "  'plugin': plugin.value, 'plugin_dist': str(plugin.dist.locate_file('')),\n"
        "  's4kv_dists': sum(d.metadata['Name'] == 's4kv' for d in md.distributions()), 'sys_path': sys.path}))\n"
    )
    result = run_installed(venv, tmp_path, str(venv / "bin" / "python"), "-c", code)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    for key in ("runtime", "kernels", "model_dir", "heldout", "plugin_dist"):
        assert Path(found[key]).resolve().is_relative_to(venv.resolve()), (key, found[key])
    assert all(found["models"].values()), found["models"]
    assert found["heldout_ok"]
    assert found["plugin"] == "s4kv.runtime.plugin:register" and found["s4kv_dists"] == 1
    assert not [p for p in found["sys_path"] if p and Path(p).resolve().is_relative_to(REPO)], found["sys_path"]
    assert not list(venv.glob("lib/python*/site-packages/tools")), "development tools must stay out of the wheel"


def test_eval_runs_from_the_wheel_on_its_bundled_model_and_text(venv, tmp_path):
    result = run_installed(venv, tmp_path, str(venv / "bin" / "s4kv"), "eval", "s4kv-ref-qwen2", "--engine",
                           "torch", "--formats", "s4kv_kivi", "--out-dir", str(tmp_path / "out"), *SMALL_EVAL)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((tmp_path / "out" / "s4kv-ref-qwen2-torch.json").read_text())
    assert Path(record["model"]).resolve().is_relative_to(venv.resolve())
    assert list(record["formats"]) == ["bf16_fa3", "s4kv_kivi"]
    assert record["formats"]["bf16_fa3"]["short"]["mean_kl"] == 0.0
    assert record["formats"]["s4kv_kivi"]["short"]["mean_kl"] > 0.0


def test_demo_runs_from_the_wheel(venv, tmp_path):
    """`s4kv demo` as the README runs it: the installed console script serves the wheel's tiny model with int4_kivi
    on vLLM's CPU engine, asks the memorized question through the openai client and prints the memorized answer."""
    pytest.importorskip("vllm")
    pytest.importorskip("openai")
    result = run_installed(venv, tmp_path, str(venv / "bin" / "s4kv"), "demo", "--port", str(free_port()),
                           timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    lines = result.stdout.splitlines()
    [serving] = [line for line in lines if line.startswith("[demo] serving ")]
    model = serving.removeprefix("[demo] serving ").split(" with ")[0]
    assert Path(model).resolve().is_relative_to(venv.resolve()) and Path(model).name == QWEN2, serving
    assert " with int4_kivi KV on the " in serving
    question, answer = FACTS[0]
    assert f"[demo] Q: {question}" in lines and f"[demo] A: {answer}" in lines, result.stdout
    assert lines[-1] == "[demo] server stopped"


def test_demo_refuses_a_folder_without_a_model(venv, tmp_path):
    result = run_installed(venv, tmp_path, str(venv / "bin" / "s4kv"), "demo", "--model", str(tmp_path / "none"))
    assert result.returncode == 2
    assert result.stderr.strip() == f"s4kv demo: no model at {tmp_path / 'none'}: --model takes a folder holding a " \
                                    "config.json"
