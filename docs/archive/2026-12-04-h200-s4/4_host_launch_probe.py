"""Host time per call of each attention-path function a mixed step runs eagerly, and where it goes (cProfile).

    . tools/device/env.sh && PYTHONPATH=$PWD:$PYTHONPATH python3 docs/archive/2026-12-04-h200-s4/4_host_launch_probe.py

Llama-3.1-8B attention shape (32 query heads, 8 KV heads, head_dim 128): a decode of 8 sequences of 2,048 tokens
(our paged attention per scheme, FA3 on bf16 as vLLM calls it), the store of a 2,056-token step, and the gather of
2,048 tokens into dense pages. Each call is timed on the host (perf_counter) with GPU work queued ahead of it, so the
host never waits for the GPU; medians of 300 calls. Then cProfile over 300 calls of int4_saw's decode and store
lists the functions that take the host's time.
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import time

import torch

from tools.device import bench_kernels as bk

CALLS = 300


def host_us(call) -> float:
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(40):  # about 0.1 s of GPU work ahead of the timed calls
        a @ a
    times = []
    for _ in range(CALLS):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    from s4kv.kernels.dense import gather_dense_kv
    from s4kv.kernels.scheme import Int4Scheme
    from s4kv.kernels.staging import allocate_pool
    from s4kv.kernels.store import store_kv

    gen = torch.Generator().manual_seed(0)
    batch, context = 8, 2048
    problem = bk.DecodeProblem(batch, context, torch.randn(batch, 32, 128, dtype=torch.bfloat16, device="cuda"),
                               torch.randn(2, batch * context, 8, 128, dtype=torch.bfloat16, device="cuda"))
    calls = {}
    out = torch.empty_like(problem.query)
    fa_table = bk.shuffled_block_table(batch, context // bk.VLLM_BLOCK_SIZE, gen).cuda()
    calls["decode fa3_bf16"] = bk.build_fa3(problem, fa_table, out)
    table = bk.shuffled_block_table(batch, context // bk.S4KV_BLOCK_SIZE, gen).cuda()
    tokens = context + batch
    key = torch.randn(tokens, 8, 128, dtype=torch.bfloat16, device="cuda")
    value = torch.randn_like(key)
    slots = torch.arange(tokens, device="cuda")
    for name in ("int4_saw", "int4_kivi"):
        scheme = Int4Scheme.parse({"scheme": name})
        calls[f"decode {name}"] = bk.build_s4kv({"scheme": name}, None, problem, table, out)
        cache = bk.fill_s4kv_cache(scheme, problem, table)
        staging = {}
        if scheme.is_kivi:
            pool = allocate_pool(tokens // 128 + 1, 8, 128, 128, key.dtype, "cuda")
            staging = dict(staged_keys=pool, staging_slots=(slots // 128).to(torch.int32))
        calls[f"store {name}"] = (lambda scheme=scheme, cache=cache, staging=staging:
                                  store_kv(key, value, cache, slots, scheme, **staging))
        dense = torch.empty(batch * context // 128, 128, 8, 128, dtype=torch.bfloat16, device="cuda")
        cu_pages = torch.arange(0, batch * context // 128 + 1, context // 128, dtype=torch.int32, device="cuda")
        calls[f"gather {name}"] = (lambda scheme=scheme, cache=cache, dense=dense, cu_pages=cu_pages:
                                   gather_dense_kv(cache, table, problem.seq_lens, cu_pages, context, scheme, dense,
                                                   torch.empty_like(dense), 128))
    print("| call | host us (median of %d) |" % CALLS)
    print("|---|---:|")
    for name, call in calls.items():
        try:
            print(f"| {name} | {host_us(call):.1f} |", flush=True)
        except Exception as exc:  # one failing call does not hide the others
            print(f"| {name} | {type(exc).__name__}: {exc} |", flush=True)
    for name in ("decode int4_saw", "store int4_saw"):
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(CALLS):
            calls[name]()
        profiler.disable()
        torch.cuda.synchronize()
        print(f"\ncProfile, {CALLS} calls of {name}:")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
