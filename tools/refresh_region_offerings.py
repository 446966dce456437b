"""Writes constructs_lib/region_offerings.json: for each catalog instance type, the regions that offer it.

Source: the EC2 DescribeInstanceTypeOfferings snapshot that moto ships (requirements-test.txt pins it),
so the CDK app can check a multi-region rollout offline. Run after bumping moto:
    python tools/refresh_region_offerings.py
tests/deploy/test_catalog.py fails when the committed file and the snapshot disagree.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUTPUT = REPO / "constructs_lib" / "region_offerings.json"


def offerings_from_moto(instance_types: list[str]) -> dict:
    import moto.ec2

    folder = Path(moto.ec2.__file__).parent / "resources" / "instance_type_offerings" / "region"
    regions: dict[str, list[str]] = {name: [] for name in instance_types}
    scanned = []
    for path in sorted(folder.glob("*.json.gz")):
        region = path.name.removesuffix(".json.gz")
        scanned.append(region)
        offered = {row["InstanceType"] for row in json.loads(gzip.open(path).read())}
        for name in instance_types:
            if name in offered:
                regions[name].append(region)
    return {"source": f"moto {moto.__version__} EC2 instance type offerings", "regions_scanned": scanned,
            "offered_in": regions}


def main() -> int:
    sys.path.insert(0, str(REPO))
    from s4kv.runtime.sizing.catalog import CATALOG

    OUTPUT.write_text(json.dumps(offerings_from_moto(list(CATALOG)), indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUTPUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
