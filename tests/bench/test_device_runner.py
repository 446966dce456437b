"""tools/device/run.sh, the GPU-machine runner, without a GPU: its help names every command it dispatches, an
unknown command fails with a message, and a command reaches its job script."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUNNER = REPO / "tools/device/run.sh"


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(RUNNER), *args], capture_output=True, text=True, timeout=60, env=env,
                          cwd=REPO)


def dispatched_commands() -> set[str]:
    cases = re.findall(r"^  ([a-z][a-z0-9-]*)\) ", RUNNER.read_text(), flags=re.M)
    return set(cases)


def test_help_documents_every_command():
    result = run("help")
    assert result.returncode == 0
    # rows of the COMMAND table: the name, its arguments (ARG or ...), two spaces, what it runs
    documented = set(re.findall(r"^  ([a-z][a-z0-9-]*)(?: \.\.\.| [A-Z0-9]+)* {2,}\S", result.stdout, flags=re.M))
    assert dispatched_commands() == documented, (dispatched_commands(), documented)
    assert len(documented) >= 9


def test_unknown_command_fails_with_the_usage():
    result = run("no-such-job")
    assert result.returncode == 2
    assert "unknown command 'no-such-job'" in result.stderr and "COMMAND" in result.stderr


def test_a_command_runs_its_job_script():
    # pair.sh refuses to start without the OUT folder a device call provides: the runner reached it.
    result = run("pair", "true", "true", env={"PATH": "/usr/bin:/bin"})
    assert result.returncode != 0 and "OUT must be set" in result.stderr
