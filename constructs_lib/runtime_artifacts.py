"""What the instance installs, as two S3 objects: this project's wheel and the hash-checked lock of every other
Python package of the runtime (deploy/locks/). No package index serves our code; PyPI serves the locked
packages, each checked against its hash (``pip install --require-hashes --no-deps``).

Two sources of the objects' location, the same user data either way:
- ``from_assets``: the CDK app (``cdk deploy``) builds the wheel at synth and ships both files as CDK assets;
- ``from_parameters``: the exported template takes bucket, keys and SHA-256 digests as parameters (no default),
  filled by ``python tools/publish_artifacts.py --bucket NAME``.
The instance role may read exactly these two objects (``read_statement``), nothing else in the bucket.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

from aws_cdk import CfnParameter, Fn, aws_s3_assets as s3_assets
from constructs import Construct

REPO = Path(__file__).resolve().parent.parent
LOCKS = REPO / "deploy" / "locks"
CUDA_LOCK = LOCKS / "runtime-cuda.txt"
PROJECT_VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
WHEEL_NAME = f"s4kv-{PROJECT_VERSION}-py3-none-any.whl"
# The wheel's sources: pyproject.toml's packages (code, bundled models, held-out text) and the files it reads
# (README, the extras' requirements files). Copied out of the tree before the build so that stale build/ or
# egg-info folders never leak into it.
WHEEL_SOURCES = ("pyproject.toml", "README.md", "runtime", "kernels", "models", "data",
                 "requirements-kernels.txt", "requirements-vllm.txt", "requirements-eval.txt",
                 "requirements-test.txt", "requirements-dev.txt")
# Zip timestamps of the wheel (setuptools honours SOURCE_DATE_EPOCH): the same sources give the same bytes, so
# the same asset and the same user data, and a redeploy without changes does not replace the instance.
SOURCE_DATE_EPOCH = "315532800"  # 1980-01-01, the earliest time a zip entry can carry
BUCKET_PATTERN = r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$"
KEY_PATTERN = r"^[A-Za-z0-9!_.*'()/-]+$"
SHA256_PATTERN = r"^[0-9a-f]{64}$"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _sources_digest() -> str:
    digest = hashlib.sha256()
    for name in WHEEL_SOURCES:
        root = REPO / name
        files = sorted(root.rglob("*")) if root.is_dir() else [root]
        for path in files:
            if path.is_file() and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def build_wheel(outdir: Path | None = None) -> Path:
    """This project's wheel (pure Python), built reproducibly from a copy of its sources; by default into
    .cache/wheels/<digest of the sources>/, where a synth of unchanged sources finds it again."""
    outdir = outdir or REPO / ".cache" / "wheels" / _sources_digest()[:16]
    if (outdir / WHEEL_NAME).is_file():
        return outdir / WHEEL_NAME
    with tempfile.TemporaryDirectory() as work:
        source = Path(work) / "s4kv"
        source.mkdir()
        for name in WHEEL_SOURCES:
            if (REPO / name).is_dir():
                shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                shutil.copy2(REPO / name, source / name)
        outdir.mkdir(parents=True, exist_ok=True)
        result = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--disable-pip-version-check",
             "--wheel-dir", str(outdir), str(source)],
            env={**os.environ, "SOURCE_DATE_EPOCH": SOURCE_DATE_EPOCH}, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"building the s4kv wheel failed: {result.stderr.strip()[-2000:]}")
    wheel = outdir / WHEEL_NAME
    if not wheel.is_file():
        raise RuntimeError(f"pip wheel did not produce {WHEEL_NAME} in {outdir}")
    return wheel


@dataclass(frozen=True)
class RuntimeArtifacts:
    """Bucket, keys and digests of the wheel and the lock (strings or tokens)."""

    bucket: str
    wheel_key: str
    wheel_sha256: str
    lock_key: str
    lock_sha256: str

    def user_data_variables(self) -> dict[str, str]:
        return {"ArtifactBucket": self.bucket, "WheelKey": self.wheel_key, "WheelSha256": self.wheel_sha256,
                "LockKey": self.lock_key, "LockSha256": self.lock_sha256}

    def object_arns(self) -> list[str]:
        return [Fn.sub("arn:${AWS::Partition}:s3:::${Bucket}/${Key}", {"Bucket": self.bucket, "Key": key})
                for key in (self.wheel_key, self.lock_key)]

    def read_statement(self) -> dict:
        return {"Sid": "RuntimeArtifacts", "Effect": "Allow", "Action": "s3:GetObject", "Resource": self.object_arns()}

    @classmethod
    def from_assets(cls, scope: Construct, wheel: Path, lock: Path) -> "RuntimeArtifacts":
        wheel_asset = s3_assets.Asset(scope, "WheelAsset", path=str(wheel))
        lock_asset = s3_assets.Asset(scope, "LockAsset", path=str(lock))
        # Both assets land in the same bootstrap bucket.
        return cls(bucket=wheel_asset.s3_bucket_name, wheel_key=wheel_asset.s3_object_key, wheel_sha256=sha256(wheel),
                   lock_key=lock_asset.s3_object_key, lock_sha256=sha256(lock))

    @classmethod
    def from_parameters(cls, scope: Construct) -> "RuntimeArtifacts":
        def param(name: str, pattern: str, description: str) -> str:
            return CfnParameter(scope, name, type="String", allowed_pattern=pattern,
                                description=description).value_as_string

        publish = "(python tools/publish_artifacts.py --bucket NAME prints all five)"
        return cls(
            bucket=param("ArtifactBucket", BUCKET_PATTERN, f"S3 bucket holding the s4kv wheel and the lock {publish}"),
            wheel_key=param("WheelKey", KEY_PATTERN, f"Key of the s4kv wheel ({WHEEL_NAME}) in ArtifactBucket"),
            wheel_sha256=param("WheelSha256", SHA256_PATTERN,
                               "SHA-256 of the wheel (hex); the instance refuses another"),
            lock_key=param("LockKey", KEY_PATTERN,
                           "Key of the runtime lock (deploy/locks/runtime-cuda.txt) in ArtifactBucket"),
            lock_sha256=param("LockSha256", SHA256_PATTERN, "SHA-256 of the lock (hex); the instance refuses another"),
        )
