"""Decode attention at the committed split rule, from a split sweep: per case FA3 on bf16 and fp8, and each scheme at
the (split count, launch) kernels/attention.py's DECODE_SPLITS picks, beside int4_saw's fastest tile-loop candidate.

    PYTHONPATH=. python docs/archive/2026-12-04-h200/committed_table.py docs/archive/2026-12-04-h200/2_sweep_splits.json
"""

import json
import sys

from s4kv.kernels.attention import DECODE_SPLITS, decode_plan
from tools.device import bench_kernels as bk

rows = json.load(open(sys.argv[1]))
cases = {}
for r in rows:
    if r.get("us"):
        cases.setdefault((r["shape"], r["batch"], r["context"]), []).append(r)
print("| shape (GQA) | batch | context | fa3_bf16 | fa3_fp8 | int4_kivi | int4_saw | int4_saw tile loop, best count |")
print("|---|---|---|---|---|---|---|---|")
for (shape, batch, context), case in sorted(cases.items(), key=lambda kv: (kv[0][0], -kv[0][1], kv[0][2])):
    hq, hkv = bk.SHAPES[shape]
    fa3 = {r["method"]: r["us"] for r in case if r["method"].startswith("fa3")}
    cells = []
    for scheme in ("int4_kivi", "int4_saw"):
        splits, warp = decode_plan(batch, hkv, case[0]["num_sms"], DECODE_SPLITS[scheme])
        (r,) = [r for r in case if r["method"] == scheme and r["splits"] == splits
                and r.get("warp_split", False) == warp]
        gbps = bk.decode_bytes(batch, context, "int4", hq, hkv) / r["us"] / 1e3
        cells.append(f"{r['us']:,.1f} us ({'w' if warp else ''}{splits}), {gbps:,.0f} GB/s, "
                     f"{fa3['fa3_bf16'] / r['us']:.2f}x")
    tiles = min(r["us"] for r in case if r["method"] == "int4_saw" and not r.get("warp_split", False))
    fa3_gbps = bk.decode_bytes(batch, context, "bf16", hq, hkv) / fa3["fa3_bf16"] / 1e3
    print(f"| {shape} ({hq // hkv}) | {batch} | {context:,} | {fa3['fa3_bf16']:,.1f} us, {fa3_gbps:,.0f} GB/s | "
          f"{fa3['fa3_bf16'] / fa3['fa3_fp8']:.2f}x | {cells[0]} | {cells[1]} | {tiles:,.1f} us |")
