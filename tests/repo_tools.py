"""Use a script of the repository's tools/ folder (not a package) in a test: import it (``load_tool``), or run a
compile-only one in its own process (``run_compile_only_tool``)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def load_tool(name: str):
    """tools/<name>.py as a module, imported once per test session."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def run_compile_only_tool(name: str, *args: str, cache_dir: Path) -> subprocess.CompletedProcess:
    """Run tools/<name>.py in its own process without TRITON_INTERPRET (it compiles for sm_90, tools/hopper_compile.py)
    and with a fresh Triton cache, so every kernel is compiled for real, not read from an earlier run."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    return subprocess.run([sys.executable, str(TOOLS / f"{name}.py"), *args], env=env, cwd=TOOLS.parent,
                          capture_output=True, text=True, timeout=900)
