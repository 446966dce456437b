"""Decode-kernel probe: the same kernel in bench_kernels' and tune_attention's harnesses, then a launch x split
sweep of both schemes (run from tools/device/ of the 2026-12-02 tree; kept with its outputs, 1_probe.*).

    . tools/device/env.sh && python3 tools/device/probe_decode.py
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

OUT = Path(os.environ.get("OUT", "."))
HQ, HKV, D, BLOCK = 28, 4, 128, 128
CASES = [(256, 4096), (32, 16384), (1, 32768)]
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def launch_of(tile, warps, stages):
    from s4kv.kernels.attention import CODE_PATHS, LaunchConfig
    return LaunchConfig(tile, warps, stages, **CODE_PATHS["subnormal+ptx"])


def grids():
    kivi = [(t, w, s) for (t, w) in ((32, 1), (64, 1), (32, 2), (64, 2), (128, 2), (64, 4), (128, 4))
            for s in (2, 3)]
    saw = [(t, w, s) for (t, w) in ((32, 1), (64, 1), (32, 2), (64, 2), (64, 4)) for s in (2, 3)]
    return {"int4_kivi": kivi, "int4_saw": saw}


def rule_splits(scheme_name, batch):
    from s4kv.kernels.attention import DECODE_SPLITS, decode_splits
    return decode_splits(batch, HKV, torch.cuda.get_device_properties(0).multi_processor_count,
                         DECODE_SPLITS[scheme_name])


def split_options(scheme_name, batch):
    r = rule_splits(scheme_name, batch)
    return sorted({r, min(r * 4, 256)})


def problem(batch, ctx, seed=0):
    import bench_kernels as bk
    g = torch.Generator().manual_seed(seed)
    pool_tokens = min(batch * ctx, bk.FILL_CHUNK_TOKENS)
    kv_pool = torch.randn(2, pool_tokens, HKV, D, dtype=torch.bfloat16, device="cuda")
    query = torch.randn(batch, HQ, D, dtype=torch.bfloat16, device="cuda")
    prob = bk.DecodeProblem(batch, ctx, query, kv_pool)
    bt = bk.shuffled_block_table(batch, -(-ctx // BLOCK), g).cuda()
    return prob, bt


def call(scheme_name, prob, cache, bt, out, splits, launch):
    import bench_kernels as bk
    from s4kv.kernels.attention import SplitWorkspace
    from s4kv.kernels.scheme import Int4Scheme
    scheme = Int4Scheme(scheme_name)
    ws = SplitWorkspace.allocate(HQ, HKV, D, "cuda", num_splits=splits, max_num_seqs=prob.batch) if splits else \
        SplitWorkspace.allocate(HQ, HKV, D, "cuda", scheme_name, max_num_seqs=prob.batch)
    return bk.s4kv_decode_call(scheme, prob, cache, bt, out, ws, launch)


def warm(job):
    """Compile one (scheme, launch, splits) on a small problem of the same specialization (worker process)."""
    scheme_name, (t, w, s), splits, pages = job
    try:
        import bench_kernels as bk
        from s4kv.kernels.scheme import Int4Scheme
        prob, bt = problem(2, pages * BLOCK)
        cache = bk.fill_s4kv_cache(Int4Scheme(scheme_name), prob, bt)
        out = torch.empty_like(prob.query)
        call(scheme_name, prob, cache, bt, out, splits, launch_of(t, w, s))()
        torch.cuda.synchronize()
        return None
    except Exception as exc:
        return f"{job}: {type(exc).__name__}: {str(exc)[:200]}"


def part_a(results):
    """Same kernel, bench_kernels' harness against tune_attention's (what differs: cache contents, timing)."""
    import bench_kernels as bk
    import tune_attention as ta
    from s4kv.kernels.scheme import Int4Scheme
    for scheme_name in ("int4_kivi", "int4_saw"):
        scheme = Int4Scheme(scheme_name)
        prob, bt = problem(256, 4096)
        cache = bk.fill_s4kv_cache(scheme, prob, bt)
        out = torch.empty_like(prob.query)
        fn = call(scheme_name, prob, cache, bt, out, None, None)
        row = dict(part="A", scheme=scheme_name, real_graph=bk.median_ms(fn) * 1e3,
                   real_direct=ta.cuda_median_ms(fn) * 1e3)
        rnd = torch.randint(0, 256, cache.shape, dtype=torch.uint8, device="cuda")
        rnd[:, :, 128 * BLOCK:].view(torch.float16).copy_(
            torch.rand(rnd[:, :, 128 * BLOCK:].shape[:2] + (rnd.shape[2] // 2 - 64 * BLOCK,), device="cuda",
                       dtype=torch.float16) * 0.1)
        fn = call(scheme_name, prob, rnd, bt, out, None, None)
        row.update(random_graph=bk.median_ms(fn) * 1e3, random_direct=ta.cuda_median_ms(fn) * 1e3)
        tcache, tbt, sl, qsl, q = ta.make_case(256, 4096, 1, "cuda")
        own = ta.own_block_inputs(scheme, 256, q, "cuda")
        from s4kv.kernels.attention import SplitWorkspace, paged_attention
        ws = SplitWorkspace.allocate(HQ, HKV, D, "cuda", scheme_name, max_num_seqs=256)
        tout = torch.empty_like(q)
        tfn = lambda: paged_attention(q, tcache, tbt, sl, qsl, 1, 0.088, scheme, tout, ws, None, **own)  # noqa: E731
        row.update(tune_direct=ta.cuda_median_ms(tfn) * 1e3, tune_graph=bk.median_ms(tfn) * 1e3)
        # the tune case's cache with the bench problem's query and own-block inputs
        fn = call(scheme_name, prob, tcache, tbt, out, None, None)
        row.update(tunecache_benchq_graph=bk.median_ms(fn) * 1e3)
        results.append(row)
        log("A", {k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()})
        del cache, rnd
        torch.cuda.empty_cache()


def part_b(results):
    import bench_kernels as bk
    from s4kv.kernels.scheme import Int4Scheme
    for batch, ctx in CASES:
        prob, bt = problem(batch, ctx, seed=1)
        for scheme_name, grid in grids().items():
            scheme = Int4Scheme(scheme_name)
            cache = bk.fill_s4kv_cache(scheme, prob, bt)
            out = torch.empty_like(prob.query)
            fn = call(scheme_name, prob, cache, bt, out, None, None)
            base_us = bk.median_ms(fn) * 1e3
            expected = out.float().clone()
            results.append(dict(part="B", scheme=scheme_name, batch=batch, ctx=ctx, tile="default", warps=0,
                                stages=0, splits=rule_splits(scheme_name, batch), us=base_us, err=0.0))
            log(f"B {scheme_name} {batch}x{ctx} default {base_us:.1f} us")
            for t, w, s in grid:
                for splits in split_options(scheme_name, batch):
                    out.fill_(float("nan"))
                    try:
                        fn = call(scheme_name, prob, cache, bt, out, splits, launch_of(t, w, s))
                        us = bk.median_ms(fn) * 1e3
                        err = float((out.float() - expected).norm() / expected.norm())
                    except Exception as exc:
                        log(f"B skip {scheme_name} {t}x{w}x{s} s{splits}: {type(exc).__name__}: {str(exc)[:150]}")
                        continue
                    results.append(dict(part="B", scheme=scheme_name, batch=batch, ctx=ctx, tile=t, warps=w,
                                        stages=s, splits=splits, us=us, err=err))
                    log(f"B {scheme_name} {batch}x{ctx} {t}x{w}x{s} splits {splits}: {us:.1f} us "
                        f"({base_us / us:.2f}x default) err {err:.1e}")
            del cache
            torch.cuda.empty_cache()
        (OUT / "probe.json").write_text(json.dumps(results, indent=1))


def main():
    results = []
    jobs = []
    for batch, ctx in CASES:
        for scheme_name, grid in grids().items():
            for cfg in grid:
                for splits in split_options(scheme_name, batch):
                    jobs.append((scheme_name, cfg, splits, 16))
    jobs = sorted(set(jobs))
    log(f"warming {len(jobs)} compiles")
    with cf.ProcessPoolExecutor(max_workers=14, mp_context=mp.get_context("spawn")) as ex:
        for err in ex.map(warm, jobs):
            if err:
                log("warm failed", err)
    log("warm done")
    try:
        part_a(results)
    except Exception:
        import traceback
        traceback.print_exc()
    (OUT / "probe.json").write_text(json.dumps(results, indent=1))
    part_b(results)
    (OUT / "probe.json").write_text(json.dumps(results, indent=1))
    log("done")


if __name__ == "__main__":
    main()
