"""Uploads what the exported template's instance installs: this project's wheel and the runtime lock, under
content-addressed keys, and prints the five template parameters that point at them.

    python tools/publish_artifacts.py --bucket my-artifacts --region us-east-1
    python tools/publish_artifacts.py --bucket my-artifacts --lock deploy/locks/runtime-cuda.txt \
        --wheel dist/s4kv-0.1.0-py3-none-any.whl

Keys: s4kv/<sha256>/<file name>. Needs boto3 and s3:PutObject on the bucket. ``cdk deploy`` does not need this:
the CDK app ships the same two files as CDK assets.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from constructs_lib.runtime_artifacts import CUDA_LOCK, build_wheel, sha256  # noqa: E402


def publish(s3, bucket: str, wheel: Path, lock: Path) -> dict[str, str]:
    """Uploads both files; returns the template parameters (name -> value)."""
    values = {"ArtifactBucket": bucket}
    for role, path in (("Wheel", wheel), ("Lock", lock)):
        digest = sha256(path)
        key = f"s4kv/{digest}/{path.name}"
        s3.put_object(Bucket=bucket, Key=key, Body=path.read_bytes())
        values[f"{role}Key"], values[f"{role}Sha256"] = key, digest
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bucket", required=True)
    parser.add_argument("--region", default=None)
    parser.add_argument("--lock", type=Path, default=CUDA_LOCK)
    parser.add_argument("--wheel", type=Path, default=None, help="an s4kv wheel (default: build one from this tree)")
    args = parser.parse_args(argv)
    import boto3

    s3 = boto3.client("s3", region_name=args.region)
    values = publish(s3, args.bucket, args.wheel or build_wheel(), args.lock)
    print(" ".join(f"{name}={value}" for name, value in values.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
