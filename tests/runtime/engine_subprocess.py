"""Run a vLLM CPU-engine job in a process of its own (vLLM's engine keeps process-wide state) and read its result:
the JSON of the last stdout line starting with ``RESULT ``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_engine_job(args: list[str], timeout: float, **env: str) -> dict:
    """``python ARGS`` from the repository root with the engine and its worker in that one process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0) plus ``env``; fails the test with the job's output tails if it fails or
    prints no result."""
    environ = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", **env)
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=environ, capture_output=True, text=True,
                          timeout=timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, f"engine job failed:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    return json.loads(lines[-1][len("RESULT "):])
