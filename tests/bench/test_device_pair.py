"""tools/device/pair.sh on the CPU: each job gets its own GPU and OUT folder, both come back in one archive, and a
failing job fails the call (what the 2-GPU device calls rely on)."""

from __future__ import annotations

import subprocess
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_pair(tmp_path, job0, job1):
    return subprocess.run(["bash", str(REPO / "tools/device/pair.sh"), job0, job1], env={"OUT": str(tmp_path),
                          "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=60)


def test_each_job_gets_its_gpu_and_folder_and_both_come_back_archived(tmp_path):
    done = run_pair(tmp_path, 'echo "gpu=$CUDA_VISIBLE_DEVICES" > "$OUT/result.txt"',
                    'sleep 0.2; echo "gpu=$CUDA_VISIBLE_DEVICES" > "$OUT/result.txt"; echo said-by-one')
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[gpu1] said-by-one" in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pair.log", "pair.tar.gz"]
    with tarfile.open(tmp_path / "pair.tar.gz") as archive:
        for gpu in (0, 1):
            assert archive.extractfile(f"gpu{gpu}/result.txt").read().decode() == f"gpu={gpu}\n"
        assert b"said-by-one" in archive.extractfile("gpu1/job.log").read()


def test_a_failing_job_fails_the_call_and_keeps_the_other_jobs_output(tmp_path):
    done = run_pair(tmp_path, "echo fine > $OUT/kept.txt", "echo broken; exit 3")
    assert done.returncode == 3
    assert "[gpu1] exit status 3" in (tmp_path / "pair.log").read_text()
    with tarfile.open(tmp_path / "pair.tar.gz") as archive:
        assert archive.extractfile("gpu0/kept.txt").read() == b"fine\n"


def test_usage_needs_two_jobs(tmp_path):
    one = subprocess.run(["bash", str(REPO / "tools/device/pair.sh"), "true"], env={"OUT": str(tmp_path)},
                         capture_output=True, text=True, timeout=60)
    assert one.returncode == 2 and "usage" in one.stdout


def test_a_call_cut_at_its_limit_still_returns_one_archive(tmp_path):
    pair = subprocess.Popen(["bash", str(REPO / "tools/device/pair.sh"), "echo early > $OUT/early.txt; sleep 30",
                             "sleep 30"], env={"OUT": str(tmp_path), "PATH": "/usr/bin:/bin"})
    deadline = time.monotonic() + 10
    while not (tmp_path / "gpu0" / "early.txt").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    pair.terminate()  # what `timeout` sends
    assert pair.wait(timeout=20) == 124
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pair.tar.gz"]
    with tarfile.open(tmp_path / "pair.tar.gz") as archive:
        assert archive.extractfile("gpu0/early.txt").read() == b"early\n"
