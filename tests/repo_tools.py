"""Run a compile-only device script of tools/device/ in its own process (``run_compile_only_tool``); name a launch's
code path (``code_path_of``).

Tests import the other tools as modules (``from tools.device import bench_kernels``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

DEVICE_TOOLS = Path(__file__).resolve().parents[1] / "tools" / "device"


def run_compile_only_tool(name: str, *args: str, cache_dir: Path) -> subprocess.CompletedProcess:
    """Run tools/device/<name>.py in its own process without TRITON_INTERPRET (it compiles for sm_90,
    tools/device/hopper_compile.py) and with a fresh Triton cache, so every kernel is compiled for real, not read from
    an earlier run."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    return subprocess.run([sys.executable, str(DEVICE_TOOLS / f"{name}.py"), *args], env=env,
                          cwd=DEVICE_TOOLS.parents[1], capture_output=True, text=True, timeout=900)


def code_path_of(launch) -> str:
    """The name in kernels.attention.CODE_PATHS of the way a LaunchConfig turns codes into MMA operands."""
    from s4kv.kernels.attention import CODE_PATHS

    return next(name for name, fields in CODE_PATHS.items()
                if all(getattr(launch, field) == value for field, value in fields.items()))
