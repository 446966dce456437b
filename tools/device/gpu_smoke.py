"""Quick H200 check of the Triton kernels against the torch reference, plus rough decode timings.

Run on the GPU machine: python tools/device/gpu_smoke.py. Prints one line per case and a timing table.
"""

from __future__ import annotations

import sys
import time

import torch
import triton

from s4kv.kernels import reference as ref
from s4kv.kernels.attention import SplitWorkspace, paged_attention
from s4kv.kernels.scheme import Int4Scheme
from s4kv.kernels.staging import allocate_pool, sequence_staging_slots
from s4kv.kernels.store import store_kv

SCHEMES = [Int4Scheme("int4_kivi"), Int4Scheme("int4_saw"), Int4Scheme("int4_saw", 64, True)]
B = 128


def build(num_seqs, ctx, hq, hkv, dtype, scheme, q_len=1, gen=None):
    blocks_per_seq = -(-ctx // B)
    nb = num_seqs * blocks_per_seq + 3
    cache = torch.randint(0, 256, (nb, hkv, B * 136), dtype=torch.uint8, device="cuda")
    perm = torch.randperm(nb, device="cuda")[: num_seqs * blocks_per_seq]
    bt = perm.view(num_seqs, blocks_per_seq).int()
    k = torch.randn(num_seqs * ctx, hkv, 128, device="cuda", dtype=dtype)
    k[..., 7] *= 15  # an outlier channel, as trained keys have
    v = torch.randn_like(k)
    pos = torch.arange(ctx, device="cuda")
    slots = (bt[:, pos // B].long() * B + pos % B).reshape(-1)
    # int4_kivi stores through its staging pool: sequence i in slot i
    staging = dict(staged_keys=allocate_pool(num_seqs, hkv, B, 128, dtype, "cuda"),
                   staging_slots=sequence_staging_slots([ctx] * num_seqs, "cuda")) if scheme.is_kivi else {}
    store_kv(k, v, cache, slots, scheme, **staging)
    seq_lens = torch.full((num_seqs,), ctx, dtype=torch.int32, device="cuda")
    qsl = torch.arange(0, num_seqs * q_len + 1, q_len, dtype=torch.int32, device="cuda")
    q = torch.randn(num_seqs * q_len, hq, 128, device="cuda", dtype=dtype)
    return cache, bt, seq_lens, qsl, q, k, v, slots


def check():
    ok = True
    for dtype in (torch.bfloat16, torch.float16):
        for scheme in SCHEMES[1:]:  # int4_kivi's read rule: tests/kernels/test_own_block_gpu.py
            cases = ((3, 700, 1, 28, 4), (2, 1000, 37, 28, 4), (4, 300, 1, 8, 8), (2, 513, 64, 32, 8))
            for num_seqs, ctx, q_len, hq, hkv in cases:
                cache, bt, sl, qsl, q, k, v, slots = build(num_seqs, ctx, hq, hkv, dtype, scheme, q_len)
                c2 = torch.randint(0, 256, cache.shape, dtype=torch.uint8, device="cuda")
                c2.copy_(cache)
                # the reference store on the same pages must give the same bytes (up to rare .5 ties)
                ref_cache = cache.clone()
                ref.store_kv(k, v, ref_cache, slots, scheme)
                byte_diff = (ref_cache != cache).float().mean().item()
                out = torch.full_like(q, float("nan"))
                ws = SplitWorkspace.allocate(hq, hkv, 128, "cuda", scheme.name)
                paged_attention(q, cache, bt, sl, qsl, q_len, 128**-0.5, scheme, out, ws if q_len == 1 else None)
                r = ref.paged_attention(q, cache, bt, sl, qsl, 128**-0.5, scheme)
                err = ((out.float() - r).norm() / r.norm()).item()
                nan = torch.isnan(out).any().item()
                good = err < 2e-2 and not nan and byte_diff < 1e-3
                ok &= good
                print(f"{'ok ' if good else 'BAD'} {str(dtype):15s} "
                      f"{scheme.name}/{scheme.hadamard_block}/{int(scheme.rotate_values)} "
                      f"seqs={num_seqs} ctx={ctx} q_len={q_len} heads={hq}/{hkv}: "
                      f"rel_err={err:.2e} bytes_diff={byte_diff:.1e}", flush=True)
    return ok


def timings():
    print("\ndecode attention, Qwen2.5-7B shape (28/4 heads), bf16 queries, median of do_bench")
    print(f"{'scheme':12s} {'batch':>5s} {'ctx':>6s} {'us':>9s} {'GB/s':>7s}")
    for scheme in SCHEMES[:2]:
        for batch, ctx in ((1, 32768), (32, 16384), (256, 4096)):
            cache, bt, sl, qsl, q, *_ = build(batch, ctx, 28, 4, torch.bfloat16, scheme)
            out = torch.empty_like(q)
            ws = SplitWorkspace.allocate(28, 4, 128, "cuda", scheme.name)
            own_block = dict(new_keys=torch.randn(batch, 4, 128, device="cuda", dtype=q.dtype),
                             staged_keys=torch.randn(batch, 4, B, 128, device="cuda", dtype=q.dtype),
                             sequence_slots=torch.arange(batch, dtype=torch.int32, device="cuda")
                             ) if scheme.is_kivi else {}
            fn = lambda: paged_attention(q, cache, bt, sl, qsl, 1, 128**-0.5, scheme, out, ws, **own_block)
            ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
            nbytes = batch * ctx * 4 * 136 + 2 * q.numel() * 2
            print(f"{scheme.name:12s} {batch:5d} {ctx:6d} {ms*1e3:9.1f} {nbytes/ms/1e6:7.0f}", flush=True)
            del cache


if __name__ == "__main__":
    t = time.time()
    ok = check()
    timings()
    print(f"smoke {'PASSED' if ok else 'FAILED'} in {time.time()-t:.0f}s")
    sys.exit(0 if ok else 1)
