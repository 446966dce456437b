"""Decode attention: software-pipeline depth x tile x warps per scheme, against FA3 (bf16, fp8), one job.

Triton's pipeliner divides num_stages - 1 by (indirection levels + 1) to get each load's prefetch distance; the page
index read from the block table is one level, so 3 stages give distance 1, whose copies are issued after the tile's
compute and waited for at the next tile's start (DEPBAR.LE SB0, 0x0 in the SASS): no overlap within a program. 5
stages give distance 2.

    python3 docs/archive/2026-12-02-h200-s5/stages.py OUT.json [budget_s] [full|short]
        # repository root, after . tools/device/env.sh; short: 3 against 5 stages at the short workload's contexts
"""
import dataclasses
import json
import math
import statistics
import sys
import time

import torch
import triton.testing

sys.path.insert(0, "tools/device")
import bench_kernels as bk  # noqa: E402
from s4kv.kernels.attention import DECODE_LAUNCH, SplitWorkspace  # noqa: E402
from s4kv.kernels.scheme import Int4Scheme  # noqa: E402

out_path = sys.argv[1]
budget = float(sys.argv[2]) if len(sys.argv) > 2 else 330
plan = sys.argv[3] if len(sys.argv) > 3 else "full"
# every field that differs between trees spelled out, so a variant means the same launch at any later tree
FULL = {
    "int4_kivi": {"k_128x4x3": dict(num_stages=3), "k_128x4x5": dict(num_stages=5), "k_128x4x7": dict(num_stages=7),
                  "k_64x4x5": dict(tile=64, num_stages=5),
                  "k_64x4x5_r128": dict(tile=64, num_stages=5, max_registers=128),
                  "k_128x8x5_r128": dict(num_warps=8, num_stages=5, max_registers=128)},
    "int4_saw": {"s_64x4x3": dict(num_stages=3, paired_param_loads=False),
                 "s_64x4x5": dict(num_stages=5, paired_param_loads=False),
                 "s_64x4x7": dict(num_stages=7, paired_param_loads=False),
                 "s_128x4x5": dict(tile=128, num_stages=5, paired_param_loads=False),
                 "s_64x4x5_paired": dict(num_stages=5, paired_param_loads=True),
                 "s_128x8x5": dict(tile=128, num_warps=8, num_stages=5, paired_param_loads=False)},
}
SHORT = {
    "int4_kivi": {"k_128x4x3": dict(num_stages=3), "k_128x4x5": dict(num_stages=5)},
    "int4_saw": {"s_64x4x3": dict(num_stages=3, paired_param_loads=True),
                 "s_64x4x5": dict(num_stages=5, paired_param_loads=True)},
}
# (variants, (batch, context) points, shapes); outputs of variants that differ from the first of their scheme only in
# the stage count must match it bit for bit (paired loads round the bf16 output differently by up to an ulp)
VARIANTS, POINTS, MODEL_SHAPES = {
    "full": (FULL, ((256, 4096), (32, 32768), (1, 4096), (1, 32768), (32, 4096), (256, 32768)),
             ("qwen2.5-7b", "llama-3.1-8b")),
    "short": (SHORT, ((256, 1024), (256, 1280), (128, 1024), (64, 2048)), ("qwen2.5-7b",)),
}[plan]
BITWISE = ("k_128x4x5", "k_128x4x7", "s_64x4x5", "s_64x4x7")
ROUNDS = 3
T0 = time.time()
rows = []


KEEP = []  # each call's closure holds tensors its graph reads (FA3's scheduler metadata, the own-block keys)


def graph_of(fn):
    KEEP.append(fn)
    fn()
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


gen = torch.Generator().manual_seed(0)
torch.manual_seed(0)
for batch, ctx in POINTS:
    for shape in MODEL_SHAPES:
        if time.time() - T0 > budget:
            print(f"skip {shape} {batch}x{ctx}: budget", flush=True)
            continue
        hq, hkv = bk.SHAPES[shape]
        pool = torch.randn(2, min(batch * ctx, bk.FILL_CHUNK_TOKENS), hkv, 128, dtype=torch.bfloat16, device="cuda")
        q = torch.randn(batch, hq, 128, dtype=torch.bfloat16, device="cuda")
        prob = bk.DecodeProblem(batch, ctx, q, pool)
        tables = {s: bk.shuffled_block_table(batch, math.ceil(ctx / s), gen).cuda() for s in (16, 128)}
        graphs, outs = {}, {}
        for name, fp8 in (("fa3_bf16", False), ("fa3_fp8", True)):
            outs[name] = torch.full_like(q, float("nan"))
            graphs[name] = graph_of(bk.build_fa3(prob, tables[16], outs[name], fp8=fp8))
        for scheme_name, variants in VARIANTS.items():
            scheme = Int4Scheme.parse({"scheme": scheme_name})
            cache = bk.fill_s4kv_cache(scheme, prob, tables[128])
            ws = SplitWorkspace.allocate(hq, hkv, 128, "cuda", scheme_name, max_num_seqs=batch)
            for name, change in variants.items():
                launch = dataclasses.replace(DECODE_LAUNCH[scheme_name], **change)
                outs[name] = torch.full_like(q, float("nan"))
                try:
                    call = bk.s4kv_decode_call(scheme, prob, cache, tables[128], outs[name], ws, launch)
                    graphs[name] = graph_of(call)
                except Exception as exc:
                    print(f"  {name} failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        ref = outs["fa3_bf16"].float()
        check = {}
        for name, o in outs.items():
            if name not in graphs:
                continue
            base = "k_128x4x3" if name.startswith("k_") else "s_64x4x3" if name.startswith("s_") else None
            check[name] = dict(finite=bool(torch.isfinite(o).all()),
                               err_fa3=float((o.float() - ref).norm() / ref.norm()),
                               same_as_committed=None if base is None else bool(torch.equal(o, outs[base])),
                               diff_committed=None if base is None
                               else float((o.float() - outs[base].float()).abs().max()))
        times = {k: [] for k in graphs}
        for _ in range(ROUNDS):
            for name, g in graphs.items():
                times[name].append(triton.testing.do_bench(g.replay, warmup=10, rep=40, return_mode="median") * 1e3)
        fa3 = statistics.median(times["fa3_bf16"])
        line = []
        for name, ts in times.items():
            us = statistics.median(ts)
            fmt = "int4" if name[:2] in ("k_", "s_") else ("fp8" if "fp8" in name else "bf16")
            gbps = bk.decode_bytes(batch, ctx, fmt, hq, hkv) / (us * 1e-6) / 1e9
            rows.append(dict(shape=shape, batch=batch, ctx=ctx, variant=name, us=us, runs=ts, gbps=gbps,
                             vs_fa3=fa3 / us, **check[name]))
            line.append(f"{name} {us:.1f}us {fa3 / us:.2f}x{'' if check[name]['finite'] else ' NONFINITE'}")
        print(f"[{time.time() - T0:4.0f}s] {shape} {batch}x{ctx}: " + ", ".join(line), flush=True)
        bad = [n for n, c in check.items() if not c["finite"] or c["err_fa3"] > bk.SANITY_MAX_REL_ERR
               or (n in BITWISE and not c["same_as_committed"])]
        if bad:
            print(f"  CHECK {bad}: {[check[n] for n in bad]}", flush=True)
        del graphs, outs, cache, pool
        KEEP.clear()
        torch.cuda.empty_cache()
        json.dump(rows, open(out_path, "w"), indent=1)
json.dump(rows, open(out_path, "w"), indent=1)
print(f"done in {time.time() - T0:.0f}s", flush=True)
