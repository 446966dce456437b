"""Time one tree's s4kv decode at its own committed launch (bench_kernels.build_s4kv, code_path None)."""
import json
import sys
import torch
tree = sys.argv[1]
sys.path.insert(0, f"{tree}/tools/device")
import bench_kernels as bk  # noqa: E402
rows = []
for shape in ("qwen2.5-7b", "llama-3.1-8b"):
    hq, hkv = bk.SHAPES[shape]
    pool = torch.randn(2, 1 << 20, hkv, 128, dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator().manual_seed(0)
    for batch, ctx in ((256, 32768), (256, 4096), (32, 32768), (32, 4096), (1, 32768), (1, 4096)):
        q = torch.randn(batch, hq, 128, dtype=torch.bfloat16, device="cuda")
        prob = bk.DecodeProblem(batch, ctx, q, pool)
        bt = bk.shuffled_block_table(batch, ctx // 128, gen).cuda()
        for name in ("int4_kivi", "int4_saw"):
            out = torch.full_like(q, float("nan"))
            us = bk.median_ms(bk.build_s4kv({"scheme": name}, None, prob, bt, out)) * 1e3
            rows.append(dict(tree=tree, shape=shape, batch=batch, ctx=ctx, scheme=name, us=us))
            print(f"OLDNEW {tree} {shape} {batch}x{ctx} {name} {us:.1f} us", flush=True)
            torch.cuda.empty_cache()
    del pool
json.dump(rows, open(sys.argv[2], "w"), indent=1)
