"""Decode attention at the committed split rule against the rule before it, from one split sweep: per case FA3 on
bf16 and fp8 and, per scheme, the previous DECODE_SPLITS' plan (every split at least 1 tile) and the committed one.
A committed plan's time is the sweep's own measurement of it where the sweep timed that plan ("committed" rows, for
the table the job ran with) or the same split count with every split live; otherwise it is estimated at the live
split count times the chooser's margin (marked "est."), as tools/device/sweep_splits.py estimates it.

    cd docs/archive && PYTHONPATH=../.. python 2026-12-04-h200-s3/committed_table.py \
        2026-12-04-h200-s3/1_sweep_splits.json
"""

import json
import math
import sys
from statistics import median

from s4kv.kernels.attention import DECODE_SPLITS, DecodePlan, decode_plan
from tools.device import bench_kernels as bk
from tools.device.sweep_splits import MIN_TILES_MARGIN

PREVIOUS = {
    "int4_kivi": ((0.043, 64, False, 1), (0.343, 32, False, 1), (0.686, 16, False, 1), (1.371, 8, False, 1),
                  (5.485, 2, False, 1), (math.inf, 1, False, 1)),
    "int4_saw": ((0.043, 64, False, 1), (0.121, 32, False, 1), (0.343, 16, False, 1), (0.686, 8, False, 1),
                 (1.371, 4, False, 1), (2.743, 2, False, 1), (math.inf, 1, False, 1)),
}
TILE = 128  # both schemes' decode tile on 128-token pages


def plan_time(case, scheme, plan):
    """(us, how): the sweep's time of ``plan`` in ``case``."""
    for r in case:
        if r["method"] == scheme and r.get("committed") and \
                DecodePlan(r["splits"], r.get("warp_split", False), r.get("min_split_tiles", 1)) == plan:
            return r["us"], "timed"
    live = plan.live_splits(math.ceil(case[0]["context"] / TILE))
    unsplit_live = plan._replace(min_split_tiles=1).live_splits(math.ceil(case[0]["context"] / TILE))
    count = plan.splits if live == unsplit_live else live
    for r in case:
        if r["method"] == scheme and not r.get("committed") and r["splits"] == count and \
                r.get("warp_split", False) == plan.warp_split:
            return (r["us"], "timed") if count == plan.splits else (r["us"] * MIN_TILES_MARGIN, "est.")
    return None, "-"


def name(plan):
    return f"{'w' if plan.warp_split else ''}{plan.splits}" + (f"/{plan.min_split_tiles}"
                                                              if plan.min_split_tiles > 1 else "")


cases = {}
for r in json.load(open(sys.argv[1])):
    if r.get("us"):
        cases.setdefault((r["shape"], r["batch"], r["context"]), []).append(r)
print("| shape (GQA) | batch | context | fa3_bf16 | fa3_fp8 | int4_kivi previous | int4_kivi committed | "
      "int4_saw previous | int4_saw committed |")
print("|---|---|---|---|---|---|---|---|---|")
ratios = {"int4_kivi": [], "int4_saw": []}
for (shape, batch, context), case in sorted(cases.items()):
    hq, hkv = bk.SHAPES[shape]
    fa3 = {r["method"]: r["us"] for r in case if r["method"].startswith("fa3")}
    cells = []
    for scheme in ("int4_kivi", "int4_saw"):
        before = decode_plan(batch, hkv, case[0]["num_sms"], PREVIOUS[scheme])
        now = decode_plan(batch, hkv, case[0]["num_sms"], DECODE_SPLITS[scheme])
        before_us, _ = plan_time(case, scheme, before)
        now_us, how = plan_time(case, scheme, now)
        cells.append(f"{before_us:,.1f} us ({name(before)}), {fa3['fa3_bf16'] / before_us:.2f}x")
        if now_us is None:
            cells.append(f"- ({name(now)})")
            continue
        mark = "" if how == "timed" else f" {how}"
        cells.append(f"{now_us:,.1f} us ({name(now)}{mark}), {fa3['fa3_bf16'] / now_us:.2f}x, "
                     f"previous / committed {before_us / now_us:.2f}")
        if now != before:
            ratios[scheme].append((before_us / now_us, how))
    print(f"| {shape} ({hq // hkv}) | {batch} | {context:,} | {fa3['fa3_bf16']:,.1f} us | "
          f"{fa3['fa3_bf16'] / fa3['fa3_fp8']:.2f}x | " + " | ".join(cells) + " |")
print()
for scheme, values in ratios.items():
    timed = [v for v, how in values if how == "timed"]
    print(f"{scheme}: {len(values)} cases where the plan changed ({len(timed)} timed): previous / committed "
          f"{min(v for v, _ in values):.2f}-{max(v for v, _ in values):.2f}, median {median(v for v, _ in values):.2f}")
