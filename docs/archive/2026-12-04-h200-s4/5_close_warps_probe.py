"""int4_kivi's per-channel block close (kernels/store.py `_kivi_close_kernel`) at 1-8 warps per program.

    . tools/device/env.sh && PYTHONPATH=$PWD:$PYTHONPATH python3 docs/archive/2026-12-04-h200-s4/5_close_warps_probe.py

The kernel runs one program per (token, KV head) and only programs whose token fills its block's last slot work, so
its time is the many programs that exit at once plus the few that quantize a block. Llama-3.1-8B's 8 KV heads,
head_dim 128, three steps as the engine stores them: 8 decodes beside a 2,048-token prompt (16 closes per head in
the prompt, 4 of the decodes close a block), an 8,192-token prefill chunk (64 closes), and 256 decodes of which 64
close. Median CUDA-event time per launch (triton.testing.do_bench); every warp count must write the same cache bytes.
"""

from __future__ import annotations

import torch
import triton

from s4kv.kernels.layout import PageLayout, cache_shape
from s4kv.kernels.staging import allocate_pool
from s4kv.kernels.store import _kivi_close_kernel

HEADS, DIM, BLOCK = 8, 128, 128


def step(decodes: int, closing: int, prompt: int, gen: torch.Generator):
    """(key, slot_mapping, staging_slots, pool, cache) of one step: `decodes` rows first, each its own sequence at
    a random offset of its own page (the first `closing` at offset 127), then one prompt from a block boundary on
    pages of its own."""
    pages = decodes + prompt // BLOCK + 1
    offsets = torch.randint(0, BLOCK - 1, (decodes,), generator=gen)
    offsets[:closing] = BLOCK - 1
    decode_slots = torch.randperm(decodes, generator=gen) * BLOCK + offsets  # pages [0, decodes) in random order
    prompt_slots = decodes * BLOCK + torch.arange(prompt)  # the prompt's own pages after them
    slots = torch.cat([decode_slots, prompt_slots]).cuda()
    staging = torch.cat([torch.arange(decodes), torch.full((prompt,), decodes)]).to(torch.int32).cuda()
    key = torch.randn(decodes + prompt, HEADS, DIM, dtype=torch.bfloat16, device="cuda", generator=None)
    pool = allocate_pool(decodes + 1, HEADS, BLOCK, DIM, torch.bfloat16, "cuda").normal_()
    cache = torch.zeros(cache_shape(pages, HEADS, BLOCK, DIM), dtype=torch.uint8, device="cuda")
    return key, slots, staging, pool, cache


def close(key, slots, staging, pool, cache, warps: int):
    layout = PageLayout.of_cache(cache, DIM)
    _kivi_close_kernel[(key.shape[0], HEADS)](
        key, slots, cache, cache.view(torch.float16), pool, staging,
        key.stride(0), key.stride(1), cache.stride(0), cache.stride(1), pool.stride(0), pool.stride(1),
        K_PARAMS_OFFSET=layout.k_params, BLOCK_SIZE=BLOCK, HALF=layout.half_dim, num_warps=warps,
    )


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    print("| step | programs | " + " | ".join(f"{w} warps (us)" for w in (8, 4, 2, 1)) + " | same bytes |")
    print("|---|---:|" + "---:|" * 4 + "---|")
    for name, decodes, closing, prompt in (("8 decodes + 2,048-token prompt", 8, 4, 2048),
                                           ("8,192-token chunk", 0, 0, 8192),
                                           ("256 decodes, 64 closing", 256, 64, 0)):
        key, slots, staging, pool, cache = step(decodes, closing, prompt, gen)
        times, outputs = [], []
        for warps in (8, 4, 2, 1):
            cache.zero_()
            close(key, slots, staging, pool, cache, warps)
            outputs.append(cache.clone())
            times.append(triton.testing.do_bench(lambda: close(key, slots, staging, pool, cache, warps),
                                                 warmup=25, rep=200) * 1e3)
        same = all(torch.equal(outputs[0], o) for o in outputs[1:])
        print(f"| {name} | {key.shape[0] * HEADS:,} | " + " | ".join(f"{t:.1f}" for t in times) + f" | {same} |",
              flush=True)


if __name__ == "__main__":
    main()
