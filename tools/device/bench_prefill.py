"""Prefill / chunked-prefill attention on the H200: s4kv (the fused int4 kernel, and the backend's prefill path:
int4 prefix gathered into a dense bf16 buffer with the fresh tokens, then FA3) against vLLM's FA3 on a bf16
paged cache. One call, about a minute.

python tools/device/bench_prefill.py   (needs vLLM 0.26.0's vllm_flash_attn, e.g. from shared/devicekit)
FLOPs counted: 4 * q_len * (visible keys) * Hq * 128 per sequence (QK^T and PV, causal half on the new part).
"""

from __future__ import annotations

import json
import os

import torch
import triton

from s4kv.kernels.attention import paged_attention
from s4kv.kernels.dense import gather_dense_kv
from s4kv.kernels.scheme import Int4Scheme
from s4kv.kernels.store import store_kv

HQ, HKV, D = 28, 4, 128
SCALE = D**-0.5
CASES = [  # (sequences, cached prefix, new tokens)
    (2, 0, 8192),
    (1, 14336, 2048),
    (4, 3584, 512),
    (8, 0, 2048),
]


def flops(n, prefix, q_len):
    return 4 * n * HQ * D * q_len * (prefix + (q_len + 1) / 2)


def main():
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    dev = "cuda"
    rows = []
    for n, prefix, q_len in CASES:
        ctx = prefix + q_len
        k = torch.randn(n * ctx, HKV, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        q = torch.randn(n * q_len, HQ, D, device=dev, dtype=torch.bfloat16)
        pos = torch.arange(ctx, device=dev)
        new = (pos >= prefix).repeat(n)
        k_new, v_new = k[new], v[new]
        seq_lens = torch.full((n,), ctx, dtype=torch.int32, device=dev)
        cu_q = torch.arange(0, n * q_len + 1, q_len, dtype=torch.int32, device=dev)
        out = torch.empty_like(q)
        timings = {}

        # vLLM FLASH_ATTN: everything (prefix and new tokens) from a bf16 paged cache, block 16
        pages16 = -(-ctx // 16)
        bt16 = torch.randperm(n * pages16, device=dev).view(n, pages16).int()
        cache16 = torch.empty(n * pages16, 16, HKV, 2 * D, dtype=torch.bfloat16, device=dev)
        slots16 = (bt16[:, pos // 16].long() * 16 + pos % 16).reshape(-1)
        cache16.view(-1, HKV, 2 * D)[slots16] = torch.cat([k, v], -1)
        kc, vc = cache16.split(D, -1)
        timings["fa3_bf16_paged"] = triton.testing.do_bench(lambda: flash_attn_varlen_func(
            q=q, k=kc, v=vc, out=out, cu_seqlens_q=cu_q, max_seqlen_q=q_len, seqused_k=seq_lens, max_seqlen_k=ctx,
            softmax_scale=SCALE, causal=True, block_table=bt16, fa_version=3), warmup=10, rep=50, return_mode="median")
        ref_out = out.clone()
        del cache16, kc, vc

        pages = -(-ctx // 128)
        bt = torch.randperm(n * pages, device=dev).view(n, pages).int()
        slots = (bt[:, pos // 128].long() * 128 + pos % 128).reshape(-1)
        for name in ("int4_kivi", "int4_saw"):
            scheme = Int4Scheme(name)
            cache = torch.empty(n * pages, HKV, 128 * 136, dtype=torch.uint8, device=dev)
            store_kv(k, v, cache, slots, scheme)
            fused = lambda: paged_attention(q, cache, bt, seq_lens, cu_q, q_len, SCALE, scheme, out)
            timings[f"s4kv_{name}_fused"] = triton.testing.do_bench(fused, warmup=10, rep=50, return_mode="median")
            err_fused = ((out.float() - ref_out.float()).norm() / ref_out.float().norm()).item()
            dense_k = torch.empty(n * ctx, HKV, D, device=dev, dtype=torch.bfloat16)
            dense_v = torch.empty_like(dense_k)
            cu_k = torch.arange(0, n * ctx + 1, ctx, dtype=torch.int32, device=dev)

            def split():
                gather_dense_kv(k_new, v_new, cache, bt, seq_lens, cu_q, cu_k, ctx, scheme, dense_k, dense_v)
                flash_attn_varlen_func(
                    q=q, k=dense_k, v=dense_v, out=out, cu_seqlens_q=cu_q, max_seqlen_q=q_len, cu_seqlens_k=cu_k,
                    max_seqlen_k=ctx, softmax_scale=SCALE, causal=True, fa_version=3)

            timings[f"s4kv_{name}_dense_fa3"] = triton.testing.do_bench(split, warmup=10, rep=50, return_mode="median")
            err_split = ((out.float() - ref_out.float()).norm() / ref_out.float().norm()).item()
            print(f"  {name}: rel err vs bf16: fused {err_fused:.3f} dense+fa3 {err_split:.3f}", flush=True)
            del cache
        fl = flops(n, prefix, q_len)
        for method, ms in timings.items():
            rows.append(dict(seqs=n, prefix=prefix, q_len=q_len, method=method, ms=ms, tflops=fl / ms / 1e9,
                             vs_fa3=timings["fa3_bf16_paged"] / ms))
            print(f"seqs={n} prefix={prefix:<6d} new={q_len:<5d} {method:24s} {ms*1e3:9.1f} us "
                  f"{fl/ms/1e9:6.0f} TFLOP/s "
                  f"{timings['fa3_bf16_paged']/ms:5.2f}x FA3", flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "bench_prefill.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
