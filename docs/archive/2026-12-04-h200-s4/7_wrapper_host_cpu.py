"""The kernel wrappers' own Python per call, with every Triton launch replaced by a no-op (no GPU needed).

    PYTHONPATH=$PWD python docs/archive/2026-12-04-h200-s4/7_wrapper_host_cpu.py

What a wrapper costs the host beyond its launches: argument checks, the page layout, the split plan and the grid
(Llama-3.1-8B's attention shape: 32 query heads, 8 KV heads, head_dim 128; a decode of 8 sequences of 2,048 tokens,
the store of a 2,056-token step, the gather of 8 x 2,048 tokens). Medians of 3,000 calls on one thread.
"""

from __future__ import annotations

import statistics
import time

import torch

from s4kv.kernels import attention, dense, store
from s4kv.kernels.attention import SplitWorkspace
from s4kv.kernels.layout import cache_shape
from s4kv.kernels.scheme import Int4Scheme
from s4kv.kernels.staging import allocate_pool

CALLS = 3000


class NoLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def host_us(call) -> float:
    for _ in range(100):
        call()
    times = []
    for _ in range(CALLS):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)
    for module, names in ((attention, ("_paged_attention_kernel", "_merge_splits_kernel")),
                          (store, ("_store_per_token_kernel", "_kivi_close_kernel", "_kivi_stage_kernel")),
                          (dense, ("_gather_dense_kernel",))):
        for name in names:
            setattr(module, name, NoLaunch())
    batch, context, tokens = 8, 2048, 2056
    query = torch.randn(batch, 32, 128, dtype=torch.float16)
    out = torch.empty_like(query)
    pages = batch * context // 128
    cache = torch.zeros(cache_shape(pages, 8, 128, 128), dtype=torch.uint8)
    table = torch.arange(pages, dtype=torch.int32).view(batch, -1)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    cu_q = torch.arange(batch + 1, dtype=torch.int32)
    key = torch.randn(tokens, 8, 128, dtype=torch.float16)
    slots = torch.arange(tokens)
    dense_k = torch.empty(pages, 128, 8, 128, dtype=torch.float16)
    cu_pages = torch.arange(0, pages + 1, context // 128, dtype=torch.int32)
    print(f"| call (launches replaced by a no-op) | host us (median of {CALLS}) |")
    print("|---|---:|")
    for name in ("int4_saw", "int4_kivi"):
        scheme = Int4Scheme.parse({"scheme": name})
        workspace = SplitWorkspace.allocate(32, 8, 128, "cpu", scheme_name=name, max_num_seqs=256)
        own_block, staging = {}, {}
        if scheme.is_kivi:
            pool = allocate_pool(batch + 1, 8, 128, 128, key.dtype, "cpu")
            own_block = dict(new_keys=key, staged_keys=pool, sequence_slots=torch.arange(batch, dtype=torch.int32))
            staging = dict(staged_keys=pool, staging_slots=(slots // 128).to(torch.int32).clamp(max=batch))
        calls = {
            "paged_attention, decode": lambda: attention.paged_attention(
                query, cache, table, seq_lens, cu_q, 1, 128 ** -0.5, scheme, out, workspace=workspace, **own_block),
            "store_kv": lambda: store.store_kv(key, key, cache, slots, scheme, **staging),
            "gather_dense_kv": lambda: dense.gather_dense_kv(cache, table, seq_lens, cu_pages, context, scheme,
                                                             dense_k, dense_k, 128),
        }
        for call_name, call in calls.items():
            print(f"| {name} {call_name} | {host_us(call):.1f} |", flush=True)


if __name__ == "__main__":
    main()
