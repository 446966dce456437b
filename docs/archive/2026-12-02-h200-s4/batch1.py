"""int4_kivi decode at small batches: split counts x stages x own-tile weight, against one tree's committed launch.

    python3 batch1.py TREE OUT.json [full]     # TREE's tools/device/bench_kernels; s4kv resolves to TREE's kernels
"""
import dataclasses
import json
import os
import statistics
import sys
import time

import torch

tree, out_path = sys.argv[1], sys.argv[2]
full = len(sys.argv) > 3
sys.path.insert(0, f"{tree}/tools/device")
import bench_kernels as bk  # noqa: E402

T0 = time.time()
rows = []
gen = torch.Generator().manual_seed(0)
ROUNDS = 3
for shape in ("llama-3.1-8b", "qwen2.5-7b"):
    hq, hkv = bk.SHAPES[shape]
    pool = torch.randn(2, 1 << 20, hkv, 128, dtype=torch.bfloat16, device="cuda")
    for batch, ctx in ((1, 4096), (1, 8192), (1, 16384), (1, 32768), (8, 4096), (8, 32768)):
        q = torch.randn(batch, hq, 128, dtype=torch.bfloat16, device="cuda")
        prob = bk.DecodeProblem(batch, ctx, q, pool)
        bt = bk.shuffled_block_table(batch, ctx // 128, gen).cuda()
        out = torch.full_like(q, float("nan"))
        variants = {"committed": lambda: bk.build_s4kv({"scheme": "int4_kivi"}, None, prob, bt, out)}
        if full:
            from s4kv.kernels.attention import DECODE_LAUNCH, SplitWorkspace
            from s4kv.kernels.scheme import Int4Scheme
            scheme = Int4Scheme.parse({"scheme": "int4_kivi"})
            cache = bk.fill_s4kv_cache(scheme, prob, bt)
            for splits in (16, 32, 64, 128):
                for stages in (2, 3):
                    for cost in ((1, 2, 3, 4) if stages == 3 else (1, 2)):
                        def make(splits=splits, stages=stages, cost=cost):
                            os.environ["S4KV_OWN_COST"] = str(cost)
                            ws = SplitWorkspace.allocate(hq, hkv, 128, "cuda", num_splits=splits, max_num_seqs=batch)
                            launch = dataclasses.replace(DECODE_LAUNCH["int4_kivi"], num_stages=stages)
                            return bk.s4kv_decode_call(scheme, prob, cache, bt, out, ws, launch)
                        variants[f"s{splits}_st{stages}_c{cost}"] = make
        times = {k: [] for k in variants}
        for _ in range(ROUNDS):
            for name, make in variants.items():
                fn = make()
                times[name].append(bk.median_ms(fn, 10, 40) * 1e3)
                if not torch.isfinite(out).all():
                    raise RuntimeError(f"{name}: non-finite output")
        os.environ["S4KV_OWN_COST"] = "1"
        for name, ts in times.items():
            us = statistics.median(ts)
            rows.append(dict(tree=tree, shape=shape, batch=batch, ctx=ctx, variant=name, us=us, runs=ts))
        best = min(times, key=lambda k: statistics.median(times[k]))
        print(f"[{time.time() - T0:5.0f}s] {shape} {batch}x{ctx}: committed "
              f"{statistics.median(times['committed']):.1f} us; best {best} {statistics.median(times[best]):.1f} us",
              flush=True)
        torch.cuda.empty_cache()
    del pool
json.dump(rows, open(out_path, "w"), indent=1)
