"""Is an instance type offered in a region, and in which of its zones? Answered offline from
region_offerings.json (a snapshot of EC2 DescribeInstanceTypeOfferings by region and by availability-zone ID;
tools/refresh_region_offerings.py rewrites it)."""

from __future__ import annotations

import json
import sys
from functools import lru_cache
from pathlib import Path

OFFERINGS = Path(__file__).parent / "region_offerings.json"


@lru_cache(maxsize=1)
def _snapshot() -> dict:
    return json.loads(OFFERINGS.read_text())


def offered_regions(instance_type: str) -> list[str]:
    return _snapshot()["offered_in"].get(instance_type, [])


def check_offered(instance_type: str, regions: tuple[str, ...] | list[str]) -> None:
    """Raises if a region of the snapshot does not offer the type; regions the snapshot lacks are
    reported on stderr and let through (no offline data to judge them)."""
    scanned = set(_snapshot()["regions_scanned"])
    offered = set(offered_regions(instance_type))
    unknown = [r for r in regions if r not in scanned]
    missing = [r for r in regions if r in scanned and r not in offered]
    if unknown:
        print(f"note: no offline offering data for {', '.join(unknown)}; not checked", file=sys.stderr)
    if missing:
        raise ValueError(f"{instance_type} is not offered in {', '.join(missing)} "
                         f"(offered in: {', '.join(sorted(offered)) or 'no region of the snapshot'})")


def zone_ids(instance_type: str) -> dict[str, list[str]]:
    """region -> the availability-zone IDs that offer the type (zone IDs name the same zone in every account)."""
    return _snapshot()["zone_ids"].get(instance_type, {})


def zone_key(instance_type: str) -> str:
    """The instance type as a mapping attribute name (CloudFormation allows only letters and digits there)."""
    return "".join(c for c in instance_type if c.isalnum())


def zone_mapping(instance_types: list[str]) -> dict[str, dict[str, str]]:
    """A CloudFormation mapping region -> zone_key(instance type) -> the first zone ID offering it, for every
    region of the snapshot that offers at least one of the types."""
    if len({zone_key(name) for name in instance_types}) != len(instance_types):
        raise ValueError(f"two instance types share a zone key: {sorted(instance_types)}")
    table: dict[str, dict[str, str]] = {}
    for name in instance_types:
        for region, ids in zone_ids(name).items():
            table.setdefault(region, {})[zone_key(name)] = ids[0]
    return dict(sorted(table.items()))
