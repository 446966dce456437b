"""Decode attention at the committed split rule, from a split sweep: per case FA3 on bf16 and fp8, each scheme at the
(split count, launch) kernels/attention.py's DECODE_SPLITS picks, int4_saw's fastest warp-split candidate, and
int4_saw at the launch and rule before this job (64-token tile loop, warp-split loop from 256 KV-head programs) in the
earlier job's sweep where that measured the case.

    cd docs/archive && PYTHONPATH=../.. python 2026-12-04-h200-s2/committed_table.py \
        2026-12-04-h200-s2/3_sweep_splits.json 2026-12-04-h200/2_sweep_splits.json
"""

import json
import math
import sys

from s4kv.kernels.attention import DECODE_SPLITS, decode_plan
from tools.device import bench_kernels as bk

BEFORE = ((0.043, 128, False), (0.121, 64, False), (0.343, 16, False), (0.686, 8, False), (1.371, 4, False),
          (5.485, 2, True), (math.inf, 1, True))


def by_case(path):
    cases = {}
    for r in json.load(open(path)):
        if r.get("us"):
            cases.setdefault((r["shape"], r["batch"], r["context"]), []).append(r)
    return cases


def pick(case, scheme, splits, warp):
    return next(r for r in case if r["method"] == scheme and r["splits"] == splits
                and r.get("warp_split", False) == warp)


cases, before = by_case(sys.argv[1]), by_case(sys.argv[2])
print("| shape (GQA) | batch | context | fa3_bf16 | fa3_fp8 | int4_kivi | **int4_saw** | int4_saw, warp-split loop, "
      "fastest count | int4_saw before |")
print("|---|---|---|---|---|---|---|---|---|")
for (shape, batch, context), case in sorted(cases.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
    hq, hkv = bk.SHAPES[shape]
    num_sms = case[0]["num_sms"]
    fa3 = {r["method"]: r["us"] for r in case if r["method"].startswith("fa3")}
    nbytes = bk.decode_bytes(batch, context, "int4", hq, hkv)
    cells = []
    for scheme in ("int4_kivi", "int4_saw"):
        splits, warp = decode_plan(batch, hkv, num_sms, DECODE_SPLITS[scheme])
        r = pick(case, scheme, splits, warp)
        cells.append(f"{r['us']:,.1f} us ({'w' if warp else ''}{splits}), {nbytes / r['us'] / 1e3:,.0f} GB/s, "
                     f"{fa3['fa3_bf16'] / r['us']:.2f}x")
    warps = min(r["us"] for r in case if r["method"] == "int4_saw" and r.get("warp_split", False))
    old = before.get((shape, batch, context))
    if old:
        splits, warp = decode_plan(batch, hkv, num_sms, BEFORE)
        old = f"{pick(old, 'int4_saw', splits, warp)['us']:,.1f} us ({'w' if warp else ''}{splits})"
    fa3_gbps = bk.decode_bytes(batch, context, "bf16", hq, hkv) / fa3["fa3_bf16"] / 1e3
    print(f"| {shape} ({hq // hkv}) | {batch} | {context:,} | {fa3['fa3_bf16']:,.1f} us, {fa3_gbps:,.0f} GB/s | "
          f"{fa3['fa3_bf16'] / fa3['fa3_fp8']:.2f}x | {cells[0]} | {cells[1]} | {warps:,.1f} us | {old or '-'} |")
