"""Host time of one Triton launch by three paths, for int4_saw's decode kernel and its store of keys.

    . tools/device/env.sh && PYTHONPATH=$PWD:$PYTHONPATH python3 docs/archive/2026-12-04-h200-s4/6_launch_path_probe.py

(a) `kernel[grid](...)`, as the wrappers launch; (b) Triton's binder (the per-call specialization of the arguments)
then the compiled kernel's runner: what a launch cache keyed on that specialization would cost; (c) the compiled
kernel's runner alone with its arguments prepared: the floor of a Triton launch from Python. Medians of 500 calls
with GPU work queued ahead, so no call waits for the GPU.
"""

from __future__ import annotations

import statistics
import time

import torch
import triton
from triton.runtime.driver import driver

from tools.device import bench_kernels as bk

CALLS = 500


def host_us(call) -> float:
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(60):
        a @ a
    times = []
    for _ in range(CALLS):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def three_paths(name, kernel, grid, args, kwargs) -> None:
    try:
        _three_paths(name, kernel, grid, args, kwargs)
    except Exception as exc:  # one failing kernel does not hide the other
        print(f"| {name} | {type(exc).__name__}: {exc} | |", flush=True)


def _three_paths(name, kernel, grid, args, kwargs) -> None:
    device = driver.active.get_current_device()
    kernel[grid](*args, **kwargs)
    compiled = kernel.warmup(*args, grid=grid, **kwargs)
    binder = kernel.device_caches[device][4]
    bound, _, _ = binder(*args, **kwargs)
    values = tuple(bound.values())
    runner = compiled[grid]

    def via_binder():
        b, _, _ = binder(*args, **kwargs)
        runner(*b.values())

    paths = {"kernel[grid](...)": lambda: kernel[grid](*args, **kwargs), "binder + compiled runner": via_binder,
             "compiled runner": lambda: runner(*values)}
    for path, call in paths.items():
        print(f"| {name} | {path} | {host_us(call):.1f} |", flush=True)


def main() -> None:
    from s4kv.kernels import attention, store
    from s4kv.kernels.layout import PageLayout
    from s4kv.kernels.scheme import Int4Scheme

    print("| kernel | launch path | host us (median of %d) |" % CALLS)
    print("|---|---|---:|")
    scheme = Int4Scheme.parse({"scheme": "int4_saw"})
    gen = torch.Generator().manual_seed(0)
    batch, context = 8, 2048
    problem = bk.DecodeProblem(batch, context, torch.randn(batch, 32, 128, dtype=torch.bfloat16, device="cuda"),
                               torch.randn(2, batch * context, 8, 128, dtype=torch.bfloat16, device="cuda"))
    table = bk.shuffled_block_table(batch, context // bk.S4KV_BLOCK_SIZE, gen).cuda()
    cache = bk.fill_s4kv_cache(scheme, problem, table)
    layout = PageLayout.of_cache(cache, 128)

    tokens = 2056
    key = torch.randn(tokens, 8, 128, dtype=torch.bfloat16, device="cuda")
    slots = torch.arange(tokens, device="cuda")
    grid = (triton.cdiv(tokens, store.TOKENS_PER_PROGRAM), 8, 1)  # the compiled runner reads three dimensions
    three_paths("_store_per_token_kernel (keys)", store._store_per_token_kernel, grid,
                (key, slots, cache, cache.view(torch.float16), tokens, key.stride(0), key.stride(1), cache.stride(0),
                 cache.stride(1)),
                dict(CODES_OFFSET=layout.k_codes, PARAMS_OFFSET=layout.k_params, CHANNEL_MAJOR=False, ROTATE=True,
                     BLOCK_SIZE=128, HADAMARD_BLOCK=scheme.hadamard_block_for(128), TOKENS=store.TOKENS_PER_PROGRAM,
                     HALF=64))

    # the decode kernel as paged_attention launches it at one split (its merge is a second launch)
    q, out = problem.query, torch.empty_like(problem.query)
    launch = attention.DECODE_LAUNCH[scheme.name]
    seq_lens, cu_q = problem.seq_lens, problem.query_start_loc
    grid = (batch + batch, 8, 1)
    three_paths("_paged_attention_kernel (decode)", attention._paged_attention_kernel, grid,
                (q, out, cache, cache.view(torch.float16), table, seq_lens, cu_q, out, out, q, q, seq_lens,
                 128 ** -0.5 * attention.LOG2E, batch, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                 table.stride(0), cache.stride(0), cache.stride(1), q.stride(0), q.stride(1), 0, 0, 0),
                dict(GROUP=4, BLOCK_M=16, BLOCK_Q=1, TILE=launch.tile, BLOCK_SIZE=128, IS_KIVI=False,
                     HADAMARD_BLOCK=scheme.hadamard_block_for(128), ROTATE_V=False, NUM_SPLITS=1,
                     PTX_UNPACK=launch.ptx_unpack, HALF=64, PAIRED_PARAMS=launch.paired_param_loads,
                     WARP_SPLIT=False, WARPS=launch.num_warps, MIN_SPLIT_TILES=1,
                     **attention._code_format(q.dtype, launch.subnormal_codes), num_warps=launch.num_warps,
                     num_stages=launch.num_stages,
                     **({"maxnreg": launch.max_registers} if launch.max_registers else {})))


if __name__ == "__main__":
    main()
