"""Is an instance type offered in a region? Answered offline from region_offerings.json (a snapshot of
EC2 DescribeInstanceTypeOfferings; tools/refresh_region_offerings.py rewrites it)."""

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
