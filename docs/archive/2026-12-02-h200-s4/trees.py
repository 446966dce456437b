"""Both schemes at their committed launch in one tree (s4kv resolves to TREE's kernels); with --fa3 also FA3 on bf16
and fp8. python3 trees.py TREE OUT.json [--fa3]"""
import json
import sys
import time

import torch

tree, out_path = sys.argv[1], sys.argv[2]
fa3 = "--fa3" in sys.argv
sys.path.insert(0, f"{tree}/tools/device")
import bench_kernels as bk  # noqa: E402

T0 = time.time()
rows = []
for shape in ("qwen2.5-7b", "llama-3.1-8b"):
    hq, hkv = bk.SHAPES[shape]
    pool = torch.randn(2, 1 << 20, hkv, 128, dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator().manual_seed(0)
    for batch, ctx in ((256, 4096), (32, 32768), (1, 32768), (1, 4096)):
        q = torch.randn(batch, hq, 128, dtype=torch.bfloat16, device="cuda")
        prob = bk.DecodeProblem(batch, ctx, q, pool)
        methods = ["s4kv_kivi", "s4kv_saw"] + (["fa3_bf16"] if fa3 else [])
        for method in methods:
            block_size, build = bk.DECODE_METHODS[method]
            bt = bk.shuffled_block_table(batch, -(-ctx // block_size), gen).cuda()
            out = torch.full_like(q, float("nan"))
            us = bk.median_ms(build(prob, bt, out)) * 1e3
            assert torch.isfinite(out).all(), method
            rows.append(dict(tree=tree, shape=shape, batch=batch, ctx=ctx, method=method, us=us))
            print(f"[{time.time() - T0:5.0f}s] {tree.split('/')[-1]} {shape} {batch}x{ctx} {method} {us:.1f} us",
                  flush=True)
            torch.cuda.empty_cache()
    del pool
json.dump(rows, open(out_path, "w"), indent=1)
