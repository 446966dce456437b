"""tools/device/parallel.sh's `serve` step without a GPU: stand-ins for nvidia-smi and for the server worker of
tools/device/plugin_e2e.py (a fake python3 that prints the worker's RESULT line) check that both servers start
side by side with the right layout flags, that their results land in $OUT/serve.json and the logs tarball, and
that one failed check fails the step with its name, and that a step with too little time left is skipped, not
started with a timeout it cannot meet."""

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHECKS = ("chat", "completion", "stream", "n=3", "stop", "max_tokens", "too_long_400", "concurrent", "health")

# python3 stand-in: the summary (`python3 -`) runs for real; a server worker prints its argv and a RESULT line,
# with the stop check failing for the data-parallel server when FAIL_DP is set.
FAKE_PYTHON = """#!/usr/bin/env bash
if [ "$1" = - ]; then exec {python} "$@"; fi
echo "argv: $*"
stop=true
case "$*" in *data-parallel-size*) [ -n "${{FAIL_DP:-}}" ] && stop=false;; esac
checks="$(printf '\\"%s\\": true, ' {checks})"
echo "RESULT {{\\"startup_s\\": 1.0, \\"kv_line\\": \\"986,880\\", $checks \\"stop\\": $stop}}"
"""


def run_serve(tmp_path: Path, fail_dp: bool, limit_s: int = 300) -> tuple[subprocess.CompletedProcess, Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "nvidia-smi").write_text("#!/usr/bin/env bash\n"
                                        "[ \"$1\" = -L ] && printf 'GPU 0: H200\\nGPU 1: H200\\n'\n"
                                        "exit 0\n")
    checks = " ".join(c for c in CHECKS if c != "stop")
    (bin_dir / "python3").write_text(FAKE_PYTHON.format(python=sys.executable, checks=checks))
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    vllm_site = tmp_path / "site"
    (vllm_site / "vllm").mkdir(parents=True, exist_ok=True)
    (vllm_site / "vllm" / "__init__.py").write_text("")  # "installed": tools/device/env.sh skips the bundle
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(out), VLLM_SITE=str(vllm_site),
               WORK_DIR=str(tmp_path / "work"), LIMIT_S=str(limit_s))
    env.pop("DRY_RUN", None)
    if fail_dp:
        env["FAIL_DP"] = "1"
    script = str(REPO / "tools" / "device" / "parallel.sh")
    done = subprocess.run(["bash", script, "serve"], env=env, capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    return done, out


def test_serve_step_runs_both_layouts_and_collects_their_checks(tmp_path):
    done, out = run_serve(tmp_path, fail_dp=False)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((out / "serve.json").read_text())
    assert set(results) == {"tp2", "dp2"}
    assert all(results[name][check] is True for name in results for check in CHECKS)
    assert "[serve] tp2: all checks passed" in done.stdout and "[serve] dp2: all checks passed" in done.stdout
    with tarfile.open(out / "logs.tar.gz") as tar:
        logs = {Path(n).name: tar.extractfile(n).read().decode() for n in tar.getnames() if n.endswith(".log")}
    assert "--tensor-parallel-size 2" in logs["tp2.log"] and "--scheme int4_kivi" in logs["tp2.log"]
    assert "--raw" not in logs["tp2.log"]  # through `s4kv serve`
    assert "--data-parallel-size 2" in logs["dp2.log"] and "--raw" in logs["dp2.log"]
    assert "--scheme int4_saw" in logs["dp2.log"]


def test_a_failed_check_fails_the_step_and_names_it(tmp_path):
    done, out = run_serve(tmp_path, fail_dp=True)
    assert done.returncode == 1
    assert "[serve] dp2: FAILED stop" in done.stdout
    assert json.loads((out / "serve.json").read_text())["dp2"]["stop"] is False


def test_serve_is_skipped_when_too_little_time_is_left(tmp_path):
    """A job that reached `serve` with 51 s left once started both servers with --timeout-s -9 and recorded two
    failures."""
    done, out = run_serve(tmp_path, fail_dp=False, limit_s=150)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "serve skipped" in done.stdout and "[serve] tp2" not in done.stdout  # no server was started
    assert "the servers need 180 s" in json.loads((out / "serve.json").read_text())["skipped"]
